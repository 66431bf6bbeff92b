import gc
import os
import sys
import tempfile

import pytest

# Eight CPU devices for mesh tests; must be set before JAX initialises its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(__file__))  # the HF reference helpers
# Round-cost calibrations (speculative_k="auto") go to a directory of this run, not the user's cache.
os.environ["JAXMTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmtp-test-cache-")

import jax  # noqa: E402  (after XLA_FLAGS)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drops JAX's compiled executables after each test module. Each holds about six memory mappings,
    and the whole suite compiles enough of them (eager ops included) to reach the kernel's default
    limit of 65530 mappings per process, where the next compile crashes inside XLA."""
    yield
    jax.clear_caches()
    gc.collect()

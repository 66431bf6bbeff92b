import gc
import os
import shutil
import sys
import tempfile

import pytest

# Set before JAX initialises its backend: eight CPU devices for mesh tests, and LLVM's lowest
# optimisation level for the kernels XLA emits. Most of the tests' time is compiling, and the
# tests check what the programs compute, which the level changes only in the last bits (the demo's
# logits within 8e-6 of the default level's, its log-probabilities 1.4e-6, the same tokens); its
# decode step runs 7-8x slower. The suite took 898 s instead of 1171-1255 s on as slow a day.
# Benchmarks and users keep XLA's defaults.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0").strip()
sys.path.insert(0, os.path.dirname(__file__))  # the HF reference helpers
# Round-cost calibrations (speculative_k="auto") go to a directory of this run, not the user's cache.
_CACHE_DIR = os.environ["JAXMTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmtp-test-cache-")
# One persistent compilation cache for this run, in a new directory: the notebook's kernel and the
# CLI's subprocesses load the programs this process compiled before them (the compile-cache test
# uses a directory of its own).
os.environ["JAXMTP_COMPILE_CACHE"] = os.path.join(os.environ["JAXMTP_CACHE_DIR"], "xla")

import jax  # noqa: E402  (after XLA_FLAGS)


def pytest_sessionfinish(session, exitstatus):
    """Removes this process's cache directory (about 30 MB of compiled programs and calibrations);
    each xdist worker and the controller made one of their own."""
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drops JAX's compiled executables after a test module once the process holds many memory
    mappings: each executable holds about six, and the whole suite compiles enough of them (eager
    ops included) to reach the kernel's default limit of 65530 per process, where the next compile
    crashes inside XLA. Below half of that, the compiled code stays for the modules that reuse it."""
    yield
    if not os.path.exists("/proc/self/maps"):  # Linux only; elsewhere the limit differs
        return
    with open("/proc/self/maps") as maps:
        if sum(1 for _ in maps) > 30000:
            jax.clear_caches()
            gc.collect()

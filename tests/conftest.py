import os
import sys
import tempfile

# Eight CPU devices for mesh tests; must be set before JAX initialises its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(__file__))  # the HF reference helpers
# Round-cost calibrations (speculative_k="auto") go to a directory of this run, not the user's cache.
os.environ["JAXMTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmtp-test-cache-")

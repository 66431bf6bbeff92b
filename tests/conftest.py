import os
import sys

# Eight CPU devices for mesh tests; must be set before JAX initialises its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(__file__))  # the HF reference helpers

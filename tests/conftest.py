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
# XLA's HLO verifier, which re-checks every module after each of its passes, is off too: it checks
# XLA, not what a program computes, and took about a tenth of each compile (the demo's generate
# programs at k = 0, 1, 2 compiled in 8.4-9.6 s of CPU instead of 9.9-10.6 s, alternating runs).
# XLA's newer CPU fusion emitters are off as well, for its older ones, which generate a fusion's code
# directly instead of through several MLIR lowering stages: the tests' compiles took about a third
# less (the suite's test time summed over both workers fell by 32%, same tests, same results).
# LLVM's code generation runs on the whole module at once instead of split into parts for a pool of
# threads: the suite keeps both cores busy with its two workers, and the split costs CPU time of its
# own (a demo engine's start at k = 2, which is mostly compiling, took about a tenth less CPU time in
# alternating runs). Benchmarks and users keep XLA's defaults.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0 --xla_disable_hlo_passes=hlo-verifier"
                           " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1").strip()
sys.path.insert(0, os.path.dirname(__file__))  # the HF reference helpers
# Round-cost calibrations (speculative_k="auto") and compiled programs go to one new directory for
# the whole run, not to the user's cache: the process that starts the run makes it, and the xdist
# workers, the notebook's kernel and the CLI's subprocesses inherit it through the environment, so
# each loads what another compiled before it (JAX writes each program once and treats an entry it
# cannot read as a miss; the compile-cache test uses a directory of its own).
_OWNER = "JAXMTP_TEST_CACHE_OWNER"
if _OWNER not in os.environ:
    os.environ[_OWNER] = str(os.getpid())
    os.environ["JAXMTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmtp-test-cache-")
    os.environ["JAXMTP_COMPILE_CACHE"] = os.path.join(os.environ["JAXMTP_CACHE_DIR"], "xla")
_CACHE_DIR = os.environ["JAXMTP_CACHE_DIR"]

import jax  # noqa: E402  (after XLA_FLAGS)

from jaxmtp import compile_cache  # noqa: E402

# Every program goes through the run's cache, not only those of a process that has generated (which
# turns it on itself): the V4 tests, model inits and forward passes then load what the other worker
# compiled.
compile_cache.enable()


def pytest_sessionfinish(session, exitstatus):
    """The process that made the run's cache directory removes it (hundreds of MB of compiled
    programs), after its workers have finished."""
    if os.environ[_OWNER] == str(os.getpid()):
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

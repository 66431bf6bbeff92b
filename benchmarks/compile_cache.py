"""What the persistent compilation cache saves: the README demo command in fresh processes.

Runs `jaxmtp generate "def fibonacci(n):"` (speculative_k="auto" with the demo model) in a new
process each time, with an empty cache directory first (as on a new machine: compiling, and the
round-cost calibration that auto needs) and then --warm more times with the cache it left; also
once with JAXMTP_COMPILE_CACHE=0 (the calibration kept). Prints each process's wall time and the
median warm / cold ratio. (tools/cold_start_compare.py times the cold start against an earlier
commit's.)

    python benchmarks/compile_cache.py [--warm 3] [--cold 1] [--json benchmarks/results/compile_cache.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

ARGUMENTS = ["generate", "def fibonacci(n):", "--quiet"]
COMMAND = ["jaxmtp", *ARGUMENTS]


def seconds(env: dict, command=COMMAND, tree=None) -> float:
    """Wall time of `command` in a new process (run from `tree` when given)."""
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def cache_env(cache: str) -> dict:
    """This environment with jaxmtp's caches (calibrations, compiled programs) in `cache`."""
    env = {**os.environ, "JAXMTP_CACHE_DIR": cache}
    env.pop("JAXMTP_COMPILE_CACHE", None)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--cold", type=int, default=1, help="cold runs, each with a new empty cache")
    parser.add_argument("--json", help="write the wall times, with their provenance, here")
    args = parser.parse_args()
    colds, warm, off = [], [], None
    for i in range(args.cold):
        with tempfile.TemporaryDirectory() as cache:
            env = cache_env(cache)
            colds.append(seconds(env))
            if i == 0:
                warm = [seconds(env) for _ in range(args.warm)]
                off = seconds({**env, "JAXMTP_COMPILE_CACHE": "0"})
                files = len(os.listdir(os.path.join(cache, "xla")))
    cold = statistics.median(colds)
    print(f"{' '.join(COMMAND)}: cold {', '.join(f'{c:.1f}' for c in colds)} s (empty cache), warm "
          f"{', '.join(f'{w:.1f}' for w in warm)} s ({files} programs cached), cache off {off:.1f} s; "
          f"warm / cold = {statistics.median(warm) / cold:.2f}")
    if args.json:
        from jaxmtp.provenance import write

        write(args.json, "compile_cache", {"cold_s": cold, "warm_s": statistics.median(warm), "cache_off_s": off,
                                           "programs_cached": files},
              {"cold_s": colds, "warm_s": warm}, repeats=args.warm)


if __name__ == "__main__":
    main()

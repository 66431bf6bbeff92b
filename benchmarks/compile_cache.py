"""What the persistent compilation cache saves: the README demo command in fresh processes.

Runs `jaxmtp generate "def fibonacci(n):"` (speculative_k="auto" with the demo model) in a new
process each time, with an empty cache directory first (as on a new machine: compiling, and the
round-cost calibration that auto needs) and then --warm more times with the cache it left; also
once with JAXMTP_COMPILE_CACHE=0 (the calibration kept). Prints each process's wall time and the
median warm / cold ratio.

With --base REV: cold starts only (an empty cache each time), this tree's command and that
commit's in turn (--pairs times), and the median of this / base over the pairs: what a first run
of the demo costs now against then.

    python benchmarks/compile_cache.py [--warm 3]
    python benchmarks/compile_cache.py --base REV [--pairs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from alternate import ROOT, checkout

ARGUMENTS = ["generate", "def fibonacci(n):", "--quiet"]
COMMAND = ["jaxmtp", *ARGUMENTS]


def seconds(env: dict, command=COMMAND, tree=None) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def cache_env(cache: str) -> dict:
    """This environment with jaxmtp's caches (calibrations, compiled programs) in `cache`."""
    env = {**os.environ, "JAXMTP_CACHE_DIR": cache}
    env.pop("JAXMTP_COMPILE_CACHE", None)
    return env


def cold_seconds(tree: str) -> float:
    """The command with `tree`'s jaxmtp in a new process with an empty cache directory."""
    command = [sys.executable, "-m", "jaxmtp.cli", *ARGUMENTS]
    with tempfile.TemporaryDirectory() as cache:
        return seconds({**cache_env(cache), "PYTHONPATH": tree}, command, tree)


def compare(base: str, pairs: int) -> None:
    with checkout(base) as tree:
        times = {"base": [], "this": []}
        for _ in range(pairs):
            times["base"].append(cold_seconds(tree))
            times["this"].append(cold_seconds(ROOT))
    ratios = [t / b for t, b in zip(times["this"], times["base"])]
    print(f"{' '.join(COMMAND)}, cold (empty cache), {pairs} pairs in turn: {base} "
          f"{statistics.median(times['base']):.1f} s, this tree {statistics.median(times['this']):.1f} s; "
          f"this / {base}: median {statistics.median(ratios):.2f} (pairs: {', '.join(f'{r:.2f}' for r in ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--base", help="an earlier commit: cold starts of both, in turn")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    if args.base:
        return compare(args.base, args.pairs)
    with tempfile.TemporaryDirectory() as cache:
        env = cache_env(cache)
        cold = seconds(env)
        warm = [seconds(env) for _ in range(args.warm)]
        off = seconds({**env, "JAXMTP_COMPILE_CACHE": "0"})
        files = len(os.listdir(os.path.join(cache, "xla")))
    print(f"{' '.join(COMMAND)}: cold {cold:.1f} s (empty cache), warm {', '.join(f'{w:.1f}' for w in warm)} s "
          f"({files} programs cached), cache off {off:.1f} s; warm / cold = {statistics.median(warm) / cold:.2f}")


if __name__ == "__main__":
    main()

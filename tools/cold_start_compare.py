"""The README demo command's cold start, this tree against an earlier commit's, in turn.

Runs `python -m jaxmtp.cli generate "def fibonacci(n):"` (speculative_k="auto", the demo model) in
a new process with an empty cache directory each time (compiling, and the round-cost calibration
that auto needs), with each tree's jaxmtp in turn, --pairs times; prints each tree's median seconds
and the median of this / base over the pairs: what a first run of the demo costs against the base.
benchmarks/compile_cache.py measures the same command cold against warm in one tree.

    python tools/cold_start_compare.py --base REV [--pairs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from alternate import ROOT, checkout  # noqa: E402
from compile_cache import ARGUMENTS, COMMAND, cache_env, seconds  # noqa: E402


def cold_seconds(tree: str) -> float:
    """The command with `tree`'s jaxmtp in a new process with an empty cache directory."""
    command = [sys.executable, "-m", "jaxmtp.cli", *ARGUMENTS]
    with tempfile.TemporaryDirectory() as cache:
        return seconds({**cache_env(cache), "PYTHONPATH": tree}, command, tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (HEAD: the uncommitted changes)")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    with checkout(args.base) as tree:
        times = {"base": [], "this": []}
        for _ in range(args.pairs):
            times["base"].append(cold_seconds(tree))
            times["this"].append(cold_seconds(ROOT))
    ratios = [t / b for t, b in zip(times["this"], times["base"])]
    print(f"{' '.join(COMMAND)}, cold (empty cache), {args.pairs} pairs in turn: {args.base} "
          f"{statistics.median(times['base']):.1f} s, this tree {statistics.median(times['this']):.1f} s; "
          f"this / {args.base}: median {statistics.median(ratios):.2f} (pairs: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()

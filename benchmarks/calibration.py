"""What the round-cost calibration of speculative_k="auto" costs, and how steady its figures are.

Loads the demo model, compiles the auto loop and the plain loop for one prompt's buckets (not
timed), then calibrates --repeats times, each with an empty JAXMTP_CACHE_DIR (as on a new
machine); prints each calibration's seconds and round costs (k = 0..4, in plain steps) and the
medians. With --tree, the jaxmtp
of another checkout is measured (for before/after: run it once on each tree, alternately).

    python benchmarks/calibration.py [--repeats 5] [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", help="a checkout whose jaxmtp to measure (default: the installed one)")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    os.environ["JAXMTP_COMPILE_CACHE"] = "0"
    import jax
    from tokenizers import Tokenizer

    import jaxmtp
    from jaxmtp import generation

    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    prompt = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json")).encode(args.prompt).ids
    prepared = generation.prepare(model, [prompt], max_new_tokens=64, speculative_k="auto")
    jax.block_until_ready(prepared.run(prepared.forced(0, 1)))  # compiles the loop
    if hasattr(prepared, "plain"):  # the plain loop too, the unit of this tree's costs
        plain = prepared.plain()
        jax.block_until_ready(plain.run(plain.forced(0, 1)))
    seconds, costs = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            os.environ["JAXMTP_CACHE_DIR"] = cache
            start = time.perf_counter()
            done = generation.calibrated(prepared)
            seconds.append(time.perf_counter() - start)
        costs.append(done.costs)
        print(f"{seconds[-1]:6.2f} s  costs {[round(c, 2) for c in done.costs]}", flush=True)
    median = [statistics.median(c[k] for c in costs) for k in range(len(costs[0]))]
    print(f"{jaxmtp.__file__}: calibration median {statistics.median(seconds):.2f} s; "
          f"median costs {[round(c, 2) for c in median]}; "
          f"spread per k (max - min) {[round(max(c[k] for c in costs) - min(c[k] for c in costs), 2) for k in range(len(median))]}")


if __name__ == "__main__":
    main()

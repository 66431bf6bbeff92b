"""What the round-cost calibration of speculative_k="auto" costs, and how steady its figures are.

Loads the demo model, compiles the auto loop and the plain loop for one prompt's buckets (not
timed), then calibrates --repeats times, each with an empty JAXMTP_CACHE_DIR (as on a new
machine); prints each calibration's seconds and round costs (k = 0..3, in plain steps) and the
medians. With --tree, the jaxmtp of another checkout is measured (to compare two trees, run it
once on each, alternately).

With --windows N, the calibration's runs themselves: N repeats of the plain loop before and after
each k (P 0 P 1 ... P 4 P), their raw times kept; then, over every window of consecutive repeats,
the cost of k = 1 as the calibration takes it (the median of its time over the mean of the plain
runs beside it, windows of 7) and as a simpler rule would take it (over the first plain run of
the repeat, windows of 5 and 7): the range and the standard deviation over the windows.
--competing runs a process beside it that is busy for 0.05-0.6 s, then idle for 0.1-1 s, over and
over (a shared machine's slower spells).

    python tools/calibration.py [--repeats 5] [--tree DIR]
    python tools/calibration.py --windows 60 [--competing]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time


def busy_and_idle(seed: int) -> None:
    """Forever: busy for 0.05-0.6 s, then idle for 0.1-1 s."""
    rng = random.Random(seed)
    while True:
        end = time.perf_counter() + rng.uniform(0.05, 0.6)
        while time.perf_counter() < end:
            pass
        time.sleep(rng.uniform(0.1, 1.0))


def windows(prepared, repeats: int, competing: bool) -> None:
    """See --windows in the module docstring."""
    import numpy as np

    from jaxmtp import generation

    plain_seconds, round_seconds = generation.calibration_runs(prepared)
    k_max = prepared.static.k
    plain_seconds(), round_seconds(0)  # warm-up
    # spawned, not forked: a fork of a process that runs JAX's threads may deadlock
    spawn = multiprocessing.get_context("spawn")
    process = spawn.Process(target=busy_and_idle, args=(0,), daemon=True) if competing else None
    if process:
        process.start()
    try:
        plain, rounds = np.zeros((repeats, k_max + 2)), np.zeros((repeats, k_max + 1))
        for r in range(repeats):
            plain[r, 0] = plain_seconds()
            for k in range(k_max + 1):
                rounds[r, k] = round_seconds(k)
                plain[r, k + 1] = plain_seconds()
    finally:
        if process:
            process.terminate()
    beside = rounds / ((plain[:, :-1] + plain[:, 1:]) / 2)
    first = rounds / plain[:, :1]
    for name, ratios, size in (("beside each k, windows of 7", beside, 7),
                               ("first of the repeat, windows of 5", first, 5), ("first of the repeat, windows of 7", first, 7)):
        costs = np.array([np.median(ratios[w:w + size], axis=0) for w in range(repeats - size + 1)])
        print(f"plain runs {name}: k = 1 at {costs[:, 1].min():.2f}-{costs[:, 1].max():.2f} plain steps over "
              f"{len(costs)} windows; std per k {np.round(costs.std(axis=0), 3).tolist()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", help="a checkout whose jaxmtp to measure (default: the installed one)")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--windows", type=int, default=0, help="repeats of the calibration's runs, raw")
    parser.add_argument("--competing", action="store_true", help="with --windows: a competing process")
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
    if args.windows:
        return windows(prepared, args.windows, args.competing)
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

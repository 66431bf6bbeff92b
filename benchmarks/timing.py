"""The timing rule the benchmarks share."""

import statistics
import time

import jax


def median_seconds(fn, args, repeats):
    """Median wall time of fn(*args) after one warm-up call (which compiles)."""
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)

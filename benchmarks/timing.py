"""The timing rule the benchmarks share."""

import statistics
import time

import jax


def median_seconds(fn, args, repeats):
    """Median wall time of fn(*args) after one warm-up call (which compiles)."""
    return statistics.median(seconds_per_call(fn, args, 1, repeats))


def seconds_per_call(loop, args, calls, repeats) -> list[float]:
    """The wall time of each of `repeats` calls of loop(*args), which makes `calls` calls of what it
    times, divided by `calls`, after one warm-up call (which compiles)."""
    jax.block_until_ready(loop(*args))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(loop(*args))
        seconds.append((time.perf_counter() - start) / calls)
    return seconds

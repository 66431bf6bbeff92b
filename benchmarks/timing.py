"""The timing rule the benchmarks share."""

import json
import statistics
import subprocess
import sys
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


def alternating_processes(schemes, repeats: int) -> dict[str, list]:
    """Runs this script again with `--scheme S` for each scheme, `repeats` times, the schemes' order
    rotated by one each repeat, so that a busy spell of a shared machine falls on all of them alike
    -> {scheme: [the JSON each process printed last]}."""
    runs = {scheme: [] for scheme in schemes}
    for repeat in range(repeats):
        shift = repeat % len(schemes)
        for scheme in schemes[shift:] + schemes[:shift]:
            out = subprocess.run([sys.executable, *sys.argv, "--scheme", scheme], check=True, capture_output=True,
                                 text=True).stdout
            runs[scheme].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {repeat} {scheme}: done", flush=True)
    return runs

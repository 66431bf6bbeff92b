"""Which kernels one decode step runs, and how long each kind takes, at T rows: the main forward
of `benchmarks/decode_step.py`'s loop, traced by jax.profiler.

XLA's CPU runtime records one event per kernel (thunk) it runs; the events are grouped by kind
(the HLO name without its number: `dot`, `ynn_fusion`, `copy_bitcast_fusion`, ...) and printed per
call: how many ran and their total microseconds. Conditionals (`cond...`) and loops contain other
kernels and are left out of the sums. Tracing adds a little to every kernel, so the times read
high; the counts are exact.

    python tools/step_profile.py [--rows 1,4] [--calls 50] [--top 12] [decode_step.py's model options:
                                 --model/--config, --cache-len, --start, --tokens, --positions,
                                 --prefix-attention, --experts]
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import jax  # noqa: E402

from decode_step import add_model_arguments, decoding_model, empty_caches, plain_static, step_loops  # noqa: E402

CONTAINERS = ("cond", "while", "end:")  # events that hold other kernels' events


def kernel_events(fn, args):
    """{kind: (count, microseconds)} of the kernels one call of fn(*args) ran."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            jax.block_until_ready(fn(*args))
        with gzip.open(glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)[0]) as f:
            trace = json.load(f)
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for event in trace["traceEvents"] if isinstance(trace, dict) else trace:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith(("$", "Thunk", "Pjit", "Common")) or "Execute" in name:
            continue
        kind = re.sub(r"(\.\d+)+$", "", re.sub(r"\.clone(\.\d+)*", "", name))
        if kind.startswith(CONTAINERS):
            continue
        kinds[kind][0] += 1
        kinds[kind][1] += event.get("dur", 0.0)
    return kinds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    model = decoding_model(args)
    static = plain_static(model, args.cache_len)
    print(f"{args.config or args.model} on {jax.devices()[0].device_kind}, {model.layout}, cache {args.cache_len} "
          f"slots from position {args.start}: kernels per main forward (count, traced microseconds)")
    for rows in (int(r) for r in args.rows.split(",")):
        main_loop, _ = step_loops(static, rows, args.calls, args.start, args.tokens, args.positions)
        kinds = kernel_events(jax.jit(main_loop), (model.params, empty_caches(static, 1)))
        count, micros = (sum(v[i] for v in kinds.values()) / args.calls for i in (0, 1))
        print(f"T={rows}: {count:.0f} kernels, {micros:.0f} us")
        for kind, (n, us) in sorted(kinds.items(), key=lambda item: -item[1][1])[:args.top]:
            print(f"  {kind:<40} {n / args.calls:7.1f} {us / args.calls:8.1f} us  ({us / n:.2f} us each)")


if __name__ == "__main__":
    main()

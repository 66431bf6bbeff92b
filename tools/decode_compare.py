"""This tree's main forward against an earlier commit's, at each of --rows, run in turn.

Each engine runs `benchmarks/decode_step.py`'s main-forward loop (a jitted `fori_loop` of --calls
calls, the cache carried) in its own worker process with its own `import jaxmtp`, in the decode
layout it picks (or with what --experts / --prefix-attention force in both); the two take --pairs turns each, alternating, so that a machine whose speed drifts
from one minute to the next slows both alike. Printed per row count: each engine's median
microseconds per call, the median [quartiles] over the pairs of this / base at the same rows, and
this / the base's step at the fewest rows (the unit).

    python tools/decode_compare.py --base REV [--rows 1,4] [--calls 100] [--pairs 21]
                                   [decode_step.py's model options: --model/--config, --cache-len,
                                    --start, --tokens, --positions, --experts, --prefix-attention]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from alternate import ROOT, ask, checkout, serve, start_worker, stop  # noqa: E402


def worker(args):
    """Compiles the main loop at each of --rows, then times one run of each per request."""
    import jax
    from decode_step import decoding_model, empty_caches, plain_static, step_loops

    model = decoding_model(args)
    static = plain_static(model, args.cache_len)
    loops = {}
    for rows in (int(r) for r in args.rows.split(",")):
        loop = jax.jit(step_loops(static, rows, args.calls, args.start, args.tokens, args.positions)[0])
        loops[rows] = (loop, (model.params, empty_caches(static, 1)))
        jax.block_until_ready(loop(*loops[rows][1]))

    def answer(_):
        micros = {}
        for rows, (loop, loop_args) in loops.items():
            start = time.perf_counter()
            jax.block_until_ready(loop(*loop_args))
            micros[rows] = (time.perf_counter() - start) / args.calls * 1e6
        return micros

    serve(answer)


def _spread(ratios):
    if len(ratios) < 2:
        return f"{ratios[0]:.3f}"
    q = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def compare(args):
    """This tree's main forward against --base's, alternating; ratios per pair of runs."""
    forwarded = ["--model", args.model, "--rows", args.rows, "--calls", str(args.calls), "--cache-len",
                 str(args.cache_len), "--start", str(args.start), "--tokens", args.tokens,
                 "--positions", args.positions]
    forwarded += ["--config", args.config] if args.config else []
    forwarded += [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("experts", "prefix_attention")
                  if getattr(args, name) != "decode"]  # forced the same way in both trees
    with checkout(args.base) as base_tree:
        engines = {"base": start_worker(__file__, base_tree, forwarded), "this": start_worker(__file__, ROOT, forwarded)}
        runs = {name: [] for name in engines}
        for _ in range(args.pairs):
            for name, proc in engines.items():
                runs[name].append(ask(proc, "run"))
        stop(engines.values())
    rows = sorted(args.rows.split(","), key=int)  # as JSON keys
    unit = [run[rows[0]] for run in runs["base"]]
    print(f"main forward, us per call (median of {args.pairs} alternating runs of {args.calls} calls); ratios: "
          f"median [quartiles] over the pairs of runs; unit = {args.base}'s T={rows[0]} step")
    for t in rows:
        this, base = ([run[t] for run in runs[name]] for name in ("this", "base"))
        print(f"T={t}: {args.base} {statistics.median(base):8.1f}   this {statistics.median(this):8.1f}   "
              f"this / {args.base} T={t} {_spread([a / b for a, b in zip(this, base)])}   "
              f"this / unit {_spread([a / u for a, u in zip(this, unit)])}")


def main():
    from decode_step import add_model_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (HEAD: the uncommitted changes)")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    compare(args)


if __name__ == "__main__":
    main()

"""What the sampling filters cost: top-k and top-p thresholds found by bisection (jaxmtp.sampling,
`bisection`) against a sort of the vocabulary per row (`sort`, the definition as
tests/test_sampling.py writes it in numpy), in two places:

- the transform alone (`jaxmtp.sampling.probabilities` with both filters, per-row settings) at
  `--shapes` of logits, the two compiled side by side in this process, their calls alternating,
  their outputs compared;
- the serving engine on the demo model: what calibration measures a prefill chunk and a decode
  round at each k cost, greedy and sampling (both filters on, as calibration sets them), with the
  engine's filters as this tree has them (`bisection`) or replaced by the sorting ones (`sort`),
  each scheme in a process of its own, the processes alternating over `--repeats`.

    python benchmarks/sampling.py [--shapes 1x2048,8x2x2048,16x4x2048,4x129280] [--calls 15]
        [--repeats 3] [--slots 8] [--max-len 592] [--no-engine] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import numpy as np

from timing import alternating_processes

SCHEMES = ("bisection", "sort")


def sorted_top_k(logits, top_k):
    """logits [..., V], top_k -> where logits >= the top_k-th largest, from a descending sort."""
    import jax.numpy as jnp
    descending = -jnp.sort(-logits, axis=-1)
    index = jnp.broadcast_to(top_k - 1, logits.shape[:-1] + (1,))
    return logits >= jnp.take_along_axis(descending, index, axis=-1)


def sorted_top_p(probs, top_p):
    """probs [..., V], top_p -> the nucleus, from a descending sort and its cumulative sum."""
    import jax.numpy as jnp
    descending = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(descending, axis=-1) - descending  # the mass of the more probable tokens
    smallest = jnp.min(jnp.where(before < top_p, descending, jnp.inf), axis=-1, keepdims=True)
    return probs >= smallest


@contextlib.contextmanager
def filters(scheme: str):
    """jaxmtp.sampling with the scheme's filters while the block runs (in this process): a program
    traced there keeps them."""
    import jaxmtp.sampling as sampling
    kept = sampling._top_k_kept, sampling._top_p_kept
    if scheme == "sort":
        sampling._top_k_kept, sampling._top_p_kept = sorted_top_k, sorted_top_p
    try:
        yield
    finally:
        sampling._top_k_kept, sampling._top_p_kept = kept


def transform(args) -> dict:
    """{shape: {scheme: [seconds per call]}, and the largest difference of their outputs}."""
    import jax
    import jax.numpy as jnp

    from jaxmtp.sampling import SamplingMode, SamplingParams, probabilities

    mode = SamplingMode(greedy=False, top_k=True, top_p=True)
    rng = np.random.default_rng(0)
    out = {}
    for shape in args.shapes:
        rows, vocab = shape[0], shape[-1]
        logits = jnp.asarray((rng.normal(size=shape) * 3).astype(np.float32))
        params = SamplingParams(jnp.asarray(rng.uniform(0.5, 1.5, rows), jnp.float32),
                                jnp.asarray(rng.integers(1, vocab, rows), jnp.int32),
                                jnp.asarray(rng.uniform(0.5, 0.99, rows), jnp.float32))
        programs = {}
        for scheme in SCHEMES:  # each compiled with its filters in place (they are read as it traces)
            with filters(scheme):
                programs[scheme] = jax.jit(lambda x, p: probabilities(x, mode, p)).lower(logits, params).compile()
        results = {s: jax.block_until_ready(programs[s](logits, params)) for s in SCHEMES}
        times = {s: [] for s in SCHEMES}
        for _ in range(args.calls):
            for scheme in SCHEMES:
                began = time.perf_counter()
                jax.block_until_ready(programs[scheme](logits, params))
                times[scheme].append(time.perf_counter() - began)
        difference = float(jnp.abs(results["bisection"] - results["sort"]).max())
        out["x".join(map(str, shape))] = {"seconds": times, "max_difference": difference}
    return out


def engine_costs(args) -> dict:
    """In this process: with the scheme's filters, an engine of --slots slots calibrated; its costs."""
    import jaxmtp
    from jaxmtp.engine import Engine

    with filters(args.scheme):  # the engine compiles and calibrates its programs as it starts
        engine = Engine(jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True), slots=args.slots, max_len=args.max_len,
                        speculative_k="auto", prefix_blocks=0).start()
    costs = {mode: {str(bucket): table.tolist() for bucket, table in engine.costs[mode].items()}
             for mode in engine.costs}
    result = {"chunk_seconds": engine.chunk_seconds, "ks": list(engine.ks), "costs": costs,
              "positions": list(engine._calibration_positions())}
    engine.shutdown()
    return result


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x2048,8x2x2048,16x4x2048,4x129280",
                        help="logits shapes of the transform, rows first and the vocabulary last")
    parser.add_argument("--calls", type=int, default=15, help="timed calls of each transform")
    parser.add_argument("--repeats", type=int, default=3, help="engine processes per scheme, alternating")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=592)
    parser.add_argument("--no-engine", action="store_true", help="time the transform only")
    parser.add_argument("--json")
    parser.add_argument("--scheme", help=argparse.SUPPRESS)  # an engine process's scheme
    args = parser.parse_args(argv)
    args.shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    return args


def main():
    args = parse()
    if args.scheme:
        print(json.dumps(engine_costs(args)))
        return
    from jaxmtp import provenance

    alone = transform(args)
    print("the transform alone (ms per call, median): shape, bisection, sort, sort / bisection, largest difference")
    for shape, r in alone.items():
        b, s = (statistics.median(r["seconds"][scheme]) for scheme in SCHEMES)
        print(f"  {shape:>12} {1e3 * b:9.3f} {1e3 * s:9.3f} {s / b:7.2f}x  {r['max_difference']:.1e}", flush=True)
    engines = alternating_processes(SCHEMES, 0 if args.no_engine else args.repeats)
    medians = {}
    if not args.no_engine:
        first = engines[SCHEMES[0]][0]
        print(f"engine rounds (ms, median over processes) at k = {first['ks']}, from position {first['positions'][0]}")
        for scheme, runs in engines.items():
            costs = {mode: {bucket: np.median([r["costs"][mode][bucket] for r in runs], axis=0).tolist()
                            for bucket in first["costs"][mode]} for mode in first["costs"]}
            medians[scheme] = {"chunk_seconds": statistics.median(r["chunk_seconds"] for r in runs), "costs": costs}
            print(f"  {scheme}: prefill chunk {1e3 * medians[scheme]['chunk_seconds']:.2f} ms")
            for mode, tables in medians[scheme]["costs"].items():
                print(f"    {mode:>6} " + "; ".join(f"batch {b}: " + " ".join(f"{1e3 * s:.2f}" for s in t[0])
                                                  for b, t in tables.items()))
    if args.json:
        figures = {"settings": {"shapes": ["x".join(map(str, s)) for s in args.shapes], "calls": args.calls,
                                "slots": args.slots, "max_len": args.max_len, "model": "demo_model"},
                   "transform_medians_seconds": {shape: {s: statistics.median(r["seconds"][s]) for s in SCHEMES}
                                                 for shape, r in alone.items()},
                   "transform_max_difference": {shape: r["max_difference"] for shape, r in alone.items()},
                   "engine_medians": medians}
        provenance.write(args.json, "sampling", figures, {"transform": alone, "engine": engines}, args.repeats)


if __name__ == "__main__":
    main()

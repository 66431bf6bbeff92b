"""What choosing the greedy token costs: jnp.argmax against `jaxmtp.sampling.greedy` (one max and
one min reduction) over rows of the demo's vocabulary, each in a jitted loop of --calls calls,
alternating, median of --repeats runs.

    python benchmarks/argmax.py [--rows 1,4,8] [--vocab 2048] [--calls 1000] [--repeats 9]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jaxmtp.sampling import greedy


def loop(choose, calls):
    """calls choices, each from logits nudged by the previous result so that none can be skipped."""
    def body(_, carry):
        total, logits = carry
        return total + choose(logits + total.astype(jnp.float32) * 1e-9).sum(), logits
    return jax.jit(lambda logits: jax.lax.fori_loop(0, calls, body, (jnp.int32(0), logits))[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    forms = {"argmax": lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32), "greedy": greedy}
    print(f"us per call over [rows, {args.vocab}] float32 logits, median of {args.repeats} alternating runs")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = jax.random.normal(jax.random.key(rows), (rows, args.vocab))
        loops = {name: loop(form, args.calls) for name, form in forms.items()}
        assert len({int(f(logits)) for f in loops.values()}) == 1  # the same tokens
        times = {name: [] for name in forms}
        for _ in range(args.repeats):
            for name, f in loops.items():
                start = time.perf_counter()
                f(logits).block_until_ready()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"rows {rows}: " + "  ".join(f"{name} {us:6.2f}" for name, us in medians.items())
              + f"  greedy / argmax {medians['greedy'] / medians['argmax']:.2f}")


if __name__ == "__main__":
    main()

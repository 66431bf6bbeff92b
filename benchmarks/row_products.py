"""What a pair of products x[T, D] @ W[D, O] @ W'[O, D] costs at T rows, relative to one row, for
the widths of a model's decode step: a routed expert's up and down projections, the shared
expert's, the dense MLP's, and the output head's.

Each figure is a jitted fori_loop of `--chain` dependent pairs over distinct weights (so that the
loop measures the products, not dispatch), median of --repeats, in microseconds per pair.
The split layout's routed experts (jaxmtp.moe.split_experts) run an expert that one row chose on
that row alone: the T=1 column against the others is what that saves per pair.

    python benchmarks/row_products.py [--model DIR | --config CONFIG_JSON] [--rows 1,2,4,5] [--repeats 7]
    python benchmarks/row_products.py --working-set 1,2,4,8,12,16,24 [--rows 1,4]

--working-set MIB,...: the routed expert's pair instead, its loop cycling through that many MiB of
distinct weights: what a product costs once the weights a step reads no longer fit the CPU's caches
(a decode step over more rows routes to more experts, so it reads more distinct weights).
"""

import argparse

import jax
import jax.numpy as jnp

import jaxmtp
from timing import median_seconds


def microseconds_per_pair(rows, d_in, d_out, chain, calls, repeats):
    """x [rows, d_in] through `chain` distinct [d_in, d_out] weights in turn (each followed by one
    [d_out, d_in] weight back), `calls` times."""
    weights = jax.random.normal(jax.random.key(0), (chain, d_in, d_out), jnp.float32) * d_in ** -0.5
    splits = tuple(weights[i] for i in range(chain))  # separate buffers, as the decode layout has
    back = jax.random.normal(jax.random.key(1), (d_out, d_in), jnp.float32) * d_out ** -0.5

    def loop(x, splits, back):
        def body(_, x):
            for w in splits:  # each product feeds the next: nothing runs in parallel or is skipped
                x = jnp.tanh((x @ w) @ back)
            return x
        return jax.lax.fori_loop(0, calls, body, x)

    x = jnp.ones((rows, d_in), jnp.float32) * 0.1
    seconds = median_seconds(jax.jit(loop), (x, splits, back), repeats)
    return seconds / (calls * chain) * 1e6


def working_set(config, rows, mebibytes, repeats):
    """The routed expert's pair at each of `rows`, over loops that cycle through `mebibytes` MiB."""
    d_in, d_out = config.hidden_size, config.moe_intermediate_size
    print(f"routed expert pair {d_in} x {d_out} on {jax.devices()[0].device_kind}: microseconds per pair "
          f"(median of {repeats}) by the MiB of distinct weights each loop reads, and the ratio to the smallest")
    print(f"{'MiB':>6}" + "".join(f"{f'T={t}':>16}" for t in rows))
    first = None
    for size in mebibytes:
        chain = max(1, round(size * 2 ** 20 / (4 * d_in * d_out)))
        times = [microseconds_per_pair(t, d_in, d_out, chain, max(2, 400 // chain), repeats) for t in rows]
        first = first or times
        print(f"{size:>6g}" + "".join(f"{us:>9.2f} {us / f:>5.2f}x" for us, f in zip(times, first)), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=jaxmtp.DEMO_MODEL)
    parser.add_argument("--config", help="an HF config.json instead of --model's")
    parser.add_argument("--rows", default="1,2,4,5")
    parser.add_argument("--chain", type=int, default=16)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--working-set", help="MiB of weights per loop, comma-separated (see above)")
    args = parser.parse_args()
    config = jaxmtp.ModelConfig.from_hf_config(args.config or f"{args.model}/config.json")
    rows = [int(r) for r in args.rows.split(",")]
    if args.working_set:
        return working_set(config, rows, [float(m) for m in args.working_set.split(",")], args.repeats)
    D = config.hidden_size
    shapes = {"routed expert gate/up": (D, config.moe_intermediate_size),
              "shared expert gate/up": (D, config.moe_intermediate_size * max(config.n_shared_experts, 1)),
              "dense MLP gate/up": (D, config.intermediate_size),
              "output head": (D, config.vocab_size)}
    print(f"{args.config or args.model} on {jax.devices()[0].device_kind}: microseconds per pair of products "
          f"x[T, D] @ W[D, O] @ W'[O, D] (median of {args.repeats}), and its ratio to T=1")
    print(f"{'weight':<24}{'D x O':>12}" + "".join(f"{f'T={t}':>16}" for t in rows))
    for name, (d_in, d_out) in shapes.items():
        chain = max(2, min(args.chain, (64 << 20) // (8 * d_in * d_out)))  # at most 64 MiB of weights
        times = [microseconds_per_pair(t, d_in, d_out, chain, args.calls, args.repeats) for t in rows]
        cells = "".join(f"{us:>9.2f} {us / times[0]:>5.2f}x" for us in times)
        print(f"{name:<24}{f'{d_in} x {d_out}':>12}{cells}", flush=True)


if __name__ == "__main__":
    main()

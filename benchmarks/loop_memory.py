"""How much memory the compiled generation loop needs besides its arguments, against the size of
the KV caches it carries: a loop that copies its caches needs at least as much again.

For the demo model (or --model), one bucket per --new-tokens and --batch, greedy: the plain loop,
a fixed k and speculative_k="auto", each compiled (not run) and read from XLA's memory analysis.
With PYTHONPATH pointing at an earlier checkout, the same figures for that checkout's engine.

    python benchmarks/loop_memory.py [--new-tokens 900] [--batch 1,8] [--k 3]
"""

import argparse

import jax
import jax.numpy as jnp

import jaxmtp
from jaxmtp.decoding import advance, start
from jaxmtp.generation import prepare


def mebibytes(prepared):
    """(caches, temporaries) of the prepared batch's compiled `advance`, in MiB."""
    static, params, inputs = prepared.static, prepared.params, prepared.inputs
    state = jax.eval_shape(start, static, params, inputs)
    caches = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state.caches, state.mtp_cache)))
    program = advance.lower(static, params, state, inputs, jnp.int32(1), jnp.zeros_like(inputs.real)).compile()
    return caches / 2 ** 20, program.memory_analysis().temp_size_in_bytes / 2 ** 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=jaxmtp.DEMO_MODEL)
    parser.add_argument("--new-tokens", type=int, default=900)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()
    model = jaxmtp.load(args.model, quiet=True)
    print(f"{jaxmtp.__file__}: compiled loop's temporaries vs its KV caches, MiB, {args.new_tokens} new tokens")
    print(f"{'batch':>5} {'loop':>6} {'cache slots':>11} {'caches':>8} {'temp':>8}")
    for batch in (int(b) for b in args.batch.split(",")):
        for k in (0, args.k, "auto"):
            prepared = prepare(model, [[1, 2, 3, 4, 5]] * batch, max_new_tokens=args.new_tokens, speculative_k=k)
            caches, temp = mebibytes(prepared)
            print(f"{batch:>5} {str(k):>6} {prepared.static.cache_len:>11} {caches:>8.2f} {temp:>8.2f}", flush=True)


if __name__ == "__main__":
    main()

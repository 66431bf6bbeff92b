"""Decoding speed on one model, side by side in one run.

1. tokens/s of plain decoding and of MTP speculative decoding for k = 1..4 (`jaxmtp.bench.run`:
   compile excluded, median of --repeats runs, each prompt alone), with acceptance figures;
2. the jitted loop against a Python loop that calls a jitted prefill and a jitted decode round,
   checking on the host after each round whether every row is done (the per-step host round trip
   that engines built on Python loops pay).

    python benchmarks/generation.py --model DIR [--tokens "1,2,3;4,5"] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmtp
from jaxmtp import bench
from jaxmtp.decoding import decode_round, prefill
from jaxmtp.generation import prepare, timed_generate


def python_loop_seconds(model, prompts, repeats, **kwargs) -> tuple[list[float], list[list[int]]]:
    """Same computation as `generate`, driven round by round from Python."""
    prepared = prepare(model, prompts, **kwargs)
    static, params, inputs = prepared.static, prepared.params, prepared.inputs
    first = jax.jit(prefill, static_argnums=0)
    step = jax.jit(decode_round, static_argnums=(0, 1))

    def run():
        state = first(static, params, inputs)
        while not bool(jnp.all(state.tokens.done)):
            state = step(static, static.k, params, state, inputs)
        return jax.block_until_ready(state)

    state = run()  # compile
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = run()
        seconds.append(time.perf_counter() - start)
    seq, count = np.asarray(state.tokens.seq), np.asarray(state.tokens.count)
    tokens = [seq[i, prepared.lengths[i]:prepared.lengths[i] + count[i]].tolist() for i in range(prepared.n)]
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--tokens", default="1,2,3,4,5,6,7,8", help='prompts as token ids, ";" between prompts')
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", default="1,2,3,4")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = jaxmtp.load(args.model, quiet=True)
    prompts = [[int(t) for t in row.split(",")] for row in args.tokens.split(";")]
    kwargs = dict(max_new_tokens=args.max_new_tokens, eos_token_id=None)
    print(f"model {args.model}: {len(prompts)} prompt(s), each alone (batch 1), {args.max_new_tokens} new tokens, "
          f"greedy, {jax.devices()[0].platform}; median of {args.repeats} runs, compile excluded")
    print(bench.table(bench.run(model, prompts, [int(k) for k in args.ks.split(",")], args.max_new_tokens,
                                args.repeats)))
    for k in (0, 2):
        out, _, jitted = timed_generate(model, prompts, repeats=args.repeats, speculative_k=k, **kwargs)
        looped, tokens = python_loop_seconds(model, prompts, args.repeats, speculative_k=k, **kwargs)
        assert tokens == out.tokens
        j, p = statistics.median(jitted), statistics.median(looped)
        rounds = out.stats.main_forward_passes - 1
        print(f"k={k}: one jitted while_loop {j * 1e3:.1f} ms vs Python loop of jitted rounds {p * 1e3:.1f} ms "
              f"({rounds} rounds): jitted loop {p / j:.2f}x faster")


if __name__ == "__main__":
    main()

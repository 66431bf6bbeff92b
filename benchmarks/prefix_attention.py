"""Generation at growing lengths with the CPU decode layout's prefix attention on and off.

The demo model in its decode layout, once with `prefix_attention` (a step attends over the
shortest power-of-two prefix of the cache that holds its positions) and once without (over the
whole cache bucket), the same parameters otherwise. For each --new-tokens (each its own cache
bucket: 32-token prompt + new tokens rounded up to a power of two), both run the same held-out
prompts (batch 1, greedy, each prompt alone) alternately in this one process, --repeats times;
printed: median tokens/s of each, the median of each repeat's ratio on / off, and whether their
tokens were identical.

    python benchmarks/prefix_attention.py [--new-tokens 64,200,450,900] [--k 0] [--repeats 5]
"""

import argparse
import dataclasses
import os
import statistics
import time

import jax
from tokenizers import Tokenizer

import jaxmtp
from jaxmtp import data, generation
from jaxmtp.layout import decode_layout


def runs(model, prompts, new_tokens, k):
    """One compiled loop per prompt (batch 1): a list of callables returning the final state."""
    out = []
    for p in prompts:
        prepared = generation.calibrated(generation.prepare(model, [p], max_new_tokens=new_tokens, speculative_k=k))
        jax.block_until_ready(prepared.run())  # compiles, once per bucket
        out.append(prepared.run)
    return out


def timed(loops):
    """(seconds for all prompts, new tokens, each prompt's sequence: prompt and new tokens)."""
    start = time.perf_counter()
    states = [jax.block_until_ready(run()) for run in loops]
    seconds = time.perf_counter() - start
    counts = [int(s.count[0]) for s in states]
    return seconds, sum(counts), [s.seq[0, :int(s.n[0]) + 1].tolist() for s in states]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", default="64,200,450,900")
    parser.add_argument("--k", type=int, default=0, help="speculative_k (0: plain decoding)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    base = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    layout = decode_layout(base.config, base.params)
    models = {"on": base.with_layout(dataclasses.replace(layout, prefix_attention=True)),
              "off": base.with_layout(dataclasses.replace(layout, prefix_attention=False))}
    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    held_out = data.encode(tokenizer, data.read(data.source_files()[1]))
    prompts = data.prompts_from(held_out, args.prompts, 32)
    print(f"demo model, {args.prompts} held-out prompts of 32 tokens, batch 1, greedy, k={args.k}; "
          f"median of {args.repeats} alternating runs; tokens/s")
    print(f"{'new':>5} {'bucket':>6} {'off':>8} {'on':>8} {'on/off':>7}  same tokens")
    for new in (int(n) for n in args.new_tokens.split(",")):
        loops = {name: runs(model, prompts, new, args.k) for name, model in models.items()}
        rates, tokens = {name: [] for name in models}, {}
        for _ in range(args.repeats):
            for name in models:
                seconds, count, tokens[name] = timed(loops[name])
                rates[name].append(count / seconds)
        off, on = (statistics.median(rates[name]) for name in ("off", "on"))
        ratio = statistics.median(a / b for a, b in zip(rates["on"], rates["off"]))
        bucket = generation.bucket(32 + new + args.k + 1, 64)
        print(f"{new:>5} {bucket:>6} {off:>8.0f} {on:>8.0f} {ratio:>6.2f}x  {tokens['on'] == tokens['off']}",
              flush=True)


if __name__ == "__main__":
    main()

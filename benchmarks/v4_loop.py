"""DeepSeek-V4 decoding with its rounds in compiled loops of 16 against a host wait after every
round (`speculative.decode`'s segment_rounds = 16 against 1), side by side in one run: greedy new
tokens per second of `speculative.generate` on a tiny random V4 (family_step.py's widths, with an
MTP block), plain decoding and k = 2, batches of 1 and 4. The two take turns in each repeat; a
prefill of 64 tokens is part of every call and of both.

    python benchmarks/v4_loop.py [--new-tokens 128] [--repeats 5] [--json benchmarks/results/v4_loop.json]
"""

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from family_step import V4
from jaxmtp.models.deepseek_v4 import init_v4, speculative
from jaxmtp.provenance import write

CONFIG = dataclasses.replace(V4, max_position_embeddings=4096, num_nextn_predict_layers=1)
PROMPT = 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--ks", default="0,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures and raw times, with their provenance, here")
    args = parser.parse_args()
    model = init_v4(CONFIG)
    rng = np.random.default_rng(0)
    segments = (1, speculative.SEGMENT_ROUNDS)
    figures, raw = [], {}
    print(f"new tokens per second, median of {args.repeats} ({jax.devices()[0].device_kind})")
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = rng.integers(0, CONFIG.vocab_size, (batch, PROMPT)).tolist()
        for k in (int(k) for k in args.ks.split(",")):
            def run(segment_rounds):
                began = time.perf_counter()
                out = speculative.generate(model, prompts, args.new_tokens, k, segment_rounds=segment_rounds)
                return time.perf_counter() - began, out.tokens

            outputs = {s: run(s)[1] for s in segments}  # compiles
            times = {s: [] for s in segments}
            for _ in range(args.repeats):
                for s in segments:
                    times[s].append(run(s)[0])
            tokens = batch * args.new_tokens
            rate = {s: tokens / statistics.median(times[s]) for s in segments}
            figures.append({"batch": batch, "k": k, "new_tokens": args.new_tokens,
                            "tokens_per_s_each_round": rate[1], "tokens_per_s_loop": rate[segments[1]],
                            "speedup": rate[segments[1]] / rate[1], "loop_rounds": segments[1],
                            "same_tokens": outputs[1] == outputs[segments[1]]})
            raw[f"{batch}/{k}"] = {f"segment_{s}_s": times[s] for s in segments}
            print(f"batch {batch}, k = {k}: a host wait every round {rate[1]:8.1f}, loops of {segments[1]} "
                  f"{rate[segments[1]]:8.1f} (x{rate[segments[1]] / rate[1]:.2f}); same tokens: "
                  f"{outputs[1] == outputs[segments[1]]}", flush=True)
    if args.json:
        write(args.json, "v4_loop", figures, raw, args.repeats)


if __name__ == "__main__":
    main()

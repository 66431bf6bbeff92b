"""What streaming costs: `generate_stream` against `generate` on the same prompts, side by side.

Held-out prompts of the demo model, each alone (batch 1), greedy, at each k; both APIs compiled
first, then run alternately --repeats times. Printed per k: the median wall time of each (summed
over the prompts), their ratio, and the stream's median time to its first token (the prefill's).

    python benchmarks/streaming.py [--ks 0,2] [--prompts 4] [--max-new-tokens 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jaxmtp
from jaxmtp import data
from jaxmtp.generation import warm_up


def _generate(model, prompts, options) -> tuple[float, list]:
    start = time.perf_counter()
    tokens = [jaxmtp.generate(model, [p], **options).tokens[0] for p in prompts]
    return time.perf_counter() - start, tokens


def _stream(model, prompts, options) -> tuple[float, list[float], list]:
    """(seconds, time to the first token of each prompt, tokens)."""
    firsts, tokens = [], []
    start = time.perf_counter()
    for p in prompts:
        begun, row = time.perf_counter(), []
        for chunk in jaxmtp.generate_stream(model, p, **options):
            if not row:
                firsts.append(time.perf_counter() - begun)
            row += chunk
        tokens.append(row)
    return time.perf_counter() - start, firsts, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="0,2")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    prompts = data.held_out_prompts(tokenizer, args.prompts, args.prompt_len)
    print(f"demo model, {len(prompts)} held-out prompts of {args.prompt_len} tokens, each alone, greedy, "
          f"{args.max_new_tokens} new tokens; median of {args.repeats} alternating runs")
    for k in (int(k) for k in args.ks.split(",")):
        options = dict(max_new_tokens=args.max_new_tokens, speculative_k=k)
        warm_up(model, prompts, **options)
        whole, streamed, firsts = [], [], []
        for _ in range(args.repeats):
            seconds, expected = _generate(model, prompts, options)
            whole.append(seconds)
            seconds, first, tokens = _stream(model, prompts, options)
            assert tokens == expected, f"k={k}: the stream's tokens differ from generate's"
            streamed.append(seconds)
            firsts += first
        g, s = statistics.median(whole), statistics.median(streamed)
        print(f"k={k}: generate {g * 1e3:8.1f} ms, generate_stream {s * 1e3:8.1f} ms ({s / g:.3f}x); "
              f"first token after {statistics.median(firsts) * 1e3:.1f} ms of {s / len(prompts) * 1e3:.1f} ms "
              "per prompt")


if __name__ == "__main__":
    main()

"""Latency of the serving engine (jaxmtp.engine) under two events, each beside its baseline in one run:

- long_prompt: 8 greedy requests decode; a 2,048-token prompt arrives while they do. Their inter-token
  latency (the gap between two events that carry tokens; and that gap over the tokens it carried)
  with the long prompt against the same 8 requests alone; repeats alternate the cases. Two cases
  with the long prompt: it asks for one token (its prefill is all it adds), or for 16, when it then
  decodes beside them: every row of a round attends over the cache up to the batch's furthest
  position, so a long row makes the others' rounds dearer too.
- prefix: requests that share a 1,024-token prefix (different 64-token tails), one at a time: time to
  the first token with prefix reuse against an engine without it, and whether their tokens are equal.

The demo's context is 1,024 positions; both events need more, so the demo's weights run here with
max_position_embeddings raised to 4,096 (its rotary embedding computed for those positions; text
past 1,024 positions is beyond what it was trained on, which changes what it writes, not what a
step costs).

    python benchmarks/engine_latency.py --json benchmarks/results/engine_latency.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np
import tokenizers

import jaxmtp
from jaxmtp import data, provenance
from jaxmtp.engine import Engine, Request
from jaxmtp.model import Model


class Timeline:
    """One request's events: the time each arrived and the tokens it carried."""

    def __init__(self):
        self.began = time.perf_counter()
        self.times, self.counts, self.tokens = [], [], []
        self.done = threading.Event()

    def __call__(self, event):
        if event.tokens:
            self.times.append(time.perf_counter())
            self.counts.append(len(event.tokens))
            self.tokens.extend(event.tokens)
        if event.finish_reason is not None:
            self.done.set()

    def gaps(self) -> tuple[list[float], list[float]]:
        """(gaps between token-carrying events, each gap over the tokens it carried, once per token)."""
        gaps = np.diff(self.times).tolist()
        per_token = [g / c for g, c in zip(gaps, self.counts[1:]) for _ in range(c)]
        return gaps, per_token

    @property
    def first_token(self) -> float:
        return self.times[0] - self.began


def model_with_context(length: int) -> Model:
    model = jaxmtp.load(jaxmtp.DEMO_MODEL)
    return Model(model.config.replace(max_position_embeddings=length), model.params, model.mesh, model.layout)


def long_prompt(engine: Engine, prompts, long, *, new_tokens: int, repeats: int) -> dict:
    """p99 inter-token latency of 8 decoding requests, alone and with `long` arriving (alternating)."""
    runs = {"alone": [], "with_long_prompt": [], "with_long_request_decoding": []}
    for _ in range(repeats):
        for case in runs:
            timelines = [Timeline() for _ in prompts]
            for p, t in zip(prompts, timelines):
                engine.submit(Request(prompt=tuple(p), max_tokens=new_tokens, ignore_eos=True), t)
            extra = Timeline()
            if case != "alone":
                while not all(t.times for t in timelines):  # they are all decoding
                    time.sleep(0.001)
                time.sleep(0.02)
                tokens = 1 if case == "with_long_prompt" else 16
                engine.submit(Request(prompt=tuple(long), max_tokens=tokens, ignore_eos=True), extra)
            for t in timelines:
                t.done.wait()
            if case != "alone":
                extra.done.wait()
            gaps = [g for t in timelines for g in t.gaps()[0]]
            per_token = [g for t in timelines for g in t.gaps()[1]]
            runs[case].append({"gap_p50": float(np.percentile(gaps, 50)), "gap_p99": float(np.percentile(gaps, 99)),
                               "per_token_p50": float(np.percentile(per_token, 50)),
                               "per_token_p99": float(np.percentile(per_token, 99)),
                               "long_prompt_first_token_s": extra.first_token if extra.times else None})
    median = {case: {name: statistics.median(r[name] for r in rs) for name in ("gap_p99", "per_token_p99")}
              for case, rs in runs.items()}
    ratios = {f"{case}_{name}_ratio": median[case][name] / median["alone"][name] for case in runs if case != "alone"
              for name in ("gap_p99", "per_token_p99")}
    return {"runs": runs, "median": median, **ratios}


def prefix(engines: dict[str, Engine], shared, tails, *, new_tokens: int) -> dict:
    """Time to first token, one request at a time, with and without prefix reuse (alternating)."""
    out = {name: {"first_token_s": [], "tokens": []} for name in engines}
    warm = shared + tails[0]
    for engine in engines.values():  # the store holds the prefix before the timed requests
        t = Timeline()
        engine.submit(Request(prompt=tuple(warm), max_tokens=new_tokens), t)
        t.done.wait()
    for tail in tails[1:]:
        for name, engine in engines.items():
            t = Timeline()
            engine.submit(Request(prompt=tuple(shared + tail), max_tokens=new_tokens), t)
            t.done.wait()
            out[name]["first_token_s"].append(t.first_token)
            out[name]["tokens"].append(t.tokens)
    medians = {name: statistics.median(r["first_token_s"]) for name, r in out.items()}
    return {"first_token_s": {name: r["first_token_s"] for name, r in out.items()}, "median_first_token_s": medians,
            "speedup": medians["without_reuse"] / medians["with_reuse"],
            "identical_tokens": out["with_reuse"]["tokens"] == out["without_reuse"]["tokens"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    long_len, prefix_len, context = (256, 128, 512) if args.quick else (2048, 1024, 4096)
    new_tokens = 24 if args.quick else 96
    model = model_with_context(context)
    tokenizer = tokenizers.Tokenizer.from_file(f"{jaxmtp.DEMO_MODEL}/tokenizer.json")
    texts = data.encode(tokenizer, data.benchmark_texts())  # the shipped held-out excerpts, 6,106 tokens
    progress = (lambda m: print(m, file=sys.stderr)) if not args.quick else None
    common = dict(max_len=context, prefill_chunk=64 if args.quick else 128, sampling=False)
    engine = Engine(model, slots=16, buckets=(8, 16), prefix_blocks=0, progress=progress, **common).start()
    prompts = [texts[i * 240:i * 240 + 64 + 24 * i].tolist() for i in range(8)]
    long = texts[1920:1920 + long_len].tolist()
    latency = long_prompt(engine, prompts, long, new_tokens=new_tokens, repeats=args.repeats)
    engine.shutdown()
    shared = texts[3968:3968 + prefix_len + 1].tolist()  # the token after the chunks is shared too
    tails = [texts[5000 + 64 * i:5000 + 64 * (i + 1)].tolist() for i in range(min(1 + 2 * args.repeats, 17))]
    engines = {"with_reuse": Engine(model, slots=1, buckets=(1,), prefix_blocks=64, progress=progress, **common),
               "without_reuse": Engine(model, slots=1, buckets=(1,), prefix_blocks=0, progress=progress, **common)}
    for e in engines.values():
        e.start()
    reuse = prefix(engines, shared, tails, new_tokens=16)
    for e in engines.values():
        e.shutdown()
    figures = {"context": context, "long_prompt_tokens": long_len, "prefix_tokens": prefix_len,
               "decoding_requests": len(prompts), "new_tokens": new_tokens,
               "round_costs_ms": {m: {b: (1e3 * c).tolist() for b, c in costs.items()} for m, costs in
                                  engine.costs.items()},
               "round_costs_attended": engine.cost_reach.tolist(),
               "prefill_chunk_ms": 1e3 * engine.chunk_seconds,
               "long_prompt": {k: v for k, v in latency.items() if k != "runs"},
               "prefix": {k: v for k, v in reuse.items() if k != "first_token_s"}}
    raw = {"long_prompt": latency["runs"], "prefix_first_token_s": reuse["first_token_s"]}
    print(f"long prompt: p99 gap x{latency['with_long_prompt_gap_p99_ratio']:.2f}, p99 per token "
          f"x{latency['with_long_prompt_per_token_p99_ratio']:.2f}; decoding beside them: p99 gap "
          f"x{latency['with_long_request_decoding_gap_p99_ratio']:.2f}; "
          f"prefix reuse: first token {reuse['speedup']:.1f}x sooner, identical tokens: {reuse['identical_tokens']}")
    if args.json:
        provenance.write(args.json, "engine_latency", figures, raw, args.repeats,
                         prompts_sha256=data.prompts_sha256())


if __name__ == "__main__":
    main()

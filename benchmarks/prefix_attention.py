"""Which cache prefixes the CPU layout's attention should choose from (layout.prefix_attention), timed in
the serving engine on the demo model: decode rounds of `--buckets` rows from `--positions` (plain,
greedy, as calibration times them) and prefill chunks of `--chunks` (size@start) of a held-out prompt.

Schemes (`--schemes`), each in a process of its own, the processes alternating over `--repeats`:
- `doubling`: every pass chooses from SHORTEST_PREFIX slots, doubling, below the whole cache;
- `current`: `jaxmtp.layout.prefix_lengths` as this tree defines it (decode passes: doubling
  while at most half the cache; prefill chunks: finer steps below FINE_PREFIXES_BELOW);
- `whole`: no prefix, the whole cache.

A prefix is a slice of the cache, which XLA CPU copies before the products read it: the scheme
decides whether reading fewer slots pays for that copy.

    python benchmarks/prefix_attention.py [--schemes doubling,current,whole] [--repeats 3]
        [--max-len 576] [--buckets 8,16] [--positions 100,300,450] [--chunks 128@0,128@256,32@256]
        [--json benchmarks/results/prefix_attention.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from timing import alternating_processes

SCHEMES = ("doubling", "current", "whole")


def doubling(cache_len: int, queries: int = 1) -> tuple[int, ...]:
    """The scheme before finer prefill prefixes and the half-cache rule."""
    from jaxmtp.layout import SHORTEST_PREFIX
    lengths = []
    while (SHORTEST_PREFIX << len(lengths)) < cache_len:
        lengths.append(SHORTEST_PREFIX << len(lengths))
    return (*lengths, cache_len)


def measure(args) -> dict:
    """In this process: installs the scheme, starts an engine and times its rounds and chunks."""
    import jaxmtp
    import jaxmtp.engine.engine as engine_module
    import jaxmtp.mla as mla
    import tokenizers
    from jaxmtp import data
    from jaxmtp.engine import Engine, Request

    if args.scheme != "current":
        scheme = doubling if args.scheme == "doubling" else (lambda cache_len, queries=1: (cache_len,))
        mla.prefix_lengths = engine_module.prefix_lengths = scheme
    engine = Engine(jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True), slots=max(args.buckets), max_len=args.max_len,
                    speculative_k=0, prefix_blocks=0, sampling=False).start()
    device = engine._device
    rounds = {}
    for bucket in args.buckets:
        rows = np.arange(engine.slots) < bucket
        for position in args.positions:
            seconds = []
            for repeat in range(args.calls + 1):
                device.occupy(rows, position)
                device.ready()
                began = time.perf_counter()
                device.segment(greedy=True, bucket=bucket, k=0, rounds=8, refill=np.zeros_like(rows), early=False,
                               halt=~rows)
                device.ready()
                if repeat:
                    seconds.append((time.perf_counter() - began) / 8)
            rounds[f"{bucket}@{position}"] = seconds
    tokenizer = tokenizers.Tokenizer.from_file(f"{jaxmtp.DEMO_MODEL}/tokenizer.json")
    length = args.max_len - 1
    prompt = data.held_out_prompts(tokenizer, 1, length)[0]
    seq = np.zeros((engine.static.cache_len + engine.k_max + 1,), np.int32)
    seq[:length] = prompt
    device.begin(seq, stops=engine._stop_table(Request(prompt=tuple(prompt), max_tokens=1)), length=length, limit=1,
                 temperature=1.0, top_k=engine.model.config.vocab_size, top_p=1.0, greedy=True, seed=0)
    chunks = {}
    for size, start in args.chunks:
        seconds = []
        for repeat in range(args.calls + 1):
            device.ready()
            began = time.perf_counter()
            device.chunk(start, size, draft=False)
            device.ready()
            if repeat:
                seconds.append(time.perf_counter() - began)
        chunks[f"{size}@{start}"] = seconds
    prefixes = {"decode": [int(n) for n in mla.prefix_lengths(engine.static.cache_len)],
                "prefill": [int(n) for n in mla.prefix_lengths(engine.static.cache_len, engine.config.prefill_chunk)]}
    engine.shutdown()
    return {"rounds": rounds, "chunks": chunks, "prefixes": prefixes}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--repeats", type=int, default=3, help="processes per scheme, alternating")
    parser.add_argument("--calls", type=int, default=7, help="timed calls of each round and chunk per process")
    parser.add_argument("--max-len", type=int, default=576)
    parser.add_argument("--buckets", default="8,16")
    parser.add_argument("--positions", default="100,300,450")
    parser.add_argument("--chunks", default="128@0,128@128,128@256,128@384,32@256,64@384")
    parser.add_argument("--json")
    parser.add_argument("--scheme", help=argparse.SUPPRESS)  # a child process's scheme
    args = parser.parse_args(argv)
    args.schemes = tuple(args.schemes.split(","))
    unknown = set(args.schemes) - set(SCHEMES)
    if unknown:
        parser.error(f"--schemes: unknown {sorted(unknown)}; choose from {','.join(SCHEMES)}")
    args.buckets = tuple(int(b) for b in args.buckets.split(","))
    args.positions = tuple(int(p) for p in args.positions.split(","))
    args.chunks = tuple(tuple(int(x) for x in c.split("@")) for c in args.chunks.split(","))
    return args


def main():
    args = parse()
    if args.scheme:
        print(json.dumps(measure(args)))
        return
    from jaxmtp import provenance

    runs = alternating_processes(args.schemes, args.repeats)
    medians = {}
    for scheme, results in runs.items():
        medians[scheme] = {kind: {key: statistics.median(s for r in results for s in r[kind][key])
                                  for key in results[0][kind]} for kind in ("rounds", "chunks")}
        medians[scheme]["prefixes"] = results[0]["prefixes"]
    keys = [("rounds", k) for k in medians[args.schemes[0]]["rounds"]] + [("chunks", k) for k in
                                                                        medians[args.schemes[0]]["chunks"]]
    print(f"{'ms':>18} " + " ".join(f"{s:>9}" for s in args.schemes))
    for kind, key in keys:
        label = f"round b{key}" if kind == "rounds" else f"chunk {key}"
        print(f"{label:>18} " + " ".join(f"{1e3 * medians[s][kind][key]:9.2f}" for s in args.schemes))
    if args.json:
        figures = {"settings": {"max_len": args.max_len, "buckets": args.buckets, "positions": args.positions,
                                "chunks": [f"{s}@{t}" for s, t in args.chunks], "calls": args.calls},
                   "medians_seconds": medians}
        provenance.write(args.json, "prefix_attention", figures, runs, args.repeats)


if __name__ == "__main__":
    main()

"""Where the serving engine's time goes under a closed-loop load, in-process (no HTTP server).

`--concurrency` client threads each submit a request, wait for its last event and submit the next,
until `--requests` have run (prompts of seeded lengths cut from the held-out excerpts, as
benchmarks/serving.py cuts them; greedy, EOS ignored). Printed per repeat: output tokens/s; the
seconds the engine's thread spent in prefill (chunks and insertions, each waited for) and in
decode segments; the segments' rounds, and their live rows and batch bucket, weighted by their
time. With prefill beside the segments (EngineConfig.concurrent_prefill) the two overlap, and so
do their seconds. `--prefill beside,between` makes an engine of each and alternates their
repeats. The engines and their programs are made once; a short untimed load warms each first.

    python benchmarks/engine_profile.py [--concurrency 16] [--requests 32] [--repeats 3]
                                        [--speculative-k 0|K|auto] [--prompt-lens 32,512]
                                        [--max-tokens 64] [--prefill beside,between] [--json PATH]

Run it with PYTHONPATH at another checkout to profile that tree's engine with the same load.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time

import jaxmtp
from jaxmtp import data, provenance
from jaxmtp.engine import Engine, Request
from serving import make_prompts, tokenizer


class Profile:
    """Wraps an engine's device operations to time them (each waited for, so that its seconds are
    its own) and to log each segment's live rows, bucket and rounds."""

    def __init__(self, engine: Engine):
        self.seconds = collections.Counter()
        self.segments: list[dict] = []
        device = engine._device
        for name, waits in (("chunk", {"decode": False}), ("insert", {"staging": False})):
            setattr(device, name, self._timed("prefill", getattr(device, name), device, waits))
        segment = device.segment

        def logged(**kw):
            device.ready(staging=not engine.concurrent)
            began = time.perf_counter()
            report = segment(**kw)
            seconds = time.perf_counter() - began
            self.seconds["decode"] += seconds
            self.segments.append({"live": int((~kw["halt"]).sum()), "bucket": kw["bucket"], "k": kw["k"],
                                  "seconds": seconds})
            return report
        device.segment = logged

    def _timed(self, kind, fn, device, waits):
        def timed(*args, **kw):
            device.ready(**waits)
            began = time.perf_counter()
            out = fn(*args, **kw)
            device.ready(**waits)
            self.seconds[kind] += time.perf_counter() - began
            return out
        return timed

    def reset(self):
        self.seconds.clear()
        self.segments.clear()


def closed_loop(engine: Engine, prompts, concurrency: int, max_tokens: int) -> tuple[float, int]:
    """-> (seconds, new tokens) for every prompt run at `concurrency` requests in flight."""
    queue, lock, produced = iter(prompts), threading.Lock(), []

    def client():
        while True:
            with lock:
                prompt = next(queue, None)
            if prompt is None:
                return
            done, count = threading.Event(), [0]

            def on_event(event, done=done, count=count):
                count[0] += len(event.tokens)
                if event.finish_reason:
                    done.set()
            engine.submit(Request(prompt=prompt.ids, max_tokens=max_tokens, ignore_eos=True), on_event)
            done.wait()
            with lock:
                produced.append(count[0])

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, sum(produced)


def summary(seconds: float, tokens: int, profile: Profile, rounds: int) -> dict:
    segs = profile.segments
    total = sum(s["seconds"] for s in segs) or 1.0
    return {"seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
            "prefill_seconds": profile.seconds["prefill"], "decode_seconds": profile.seconds["decode"],
            "segments": len(segs), "rounds": rounds,
            "live_rows_by_time": sum(s["live"] * s["seconds"] for s in segs) / total,
            "bucket_by_time": sum(s["bucket"] * s["seconds"] for s in segs) / total,
            "segment_log": segs}


PREFILL = {"beside": True, "between": False}  # --prefill: EngineConfig.concurrent_prefill


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32, help="per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculative-k", default="0")
    parser.add_argument("--prompt-lens", default="32,512", help="shortest,longest prompt in tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefill", default="beside,between",
                        help="prefill beside the decode segments on a thread of its own, between them, or both "
                             "(an engine each, their repeats alternating)")
    parser.add_argument("--json", help="write the figures, with their provenance, here")
    args = parser.parse_args()
    lens = tuple(int(x) for x in args.prompt_lens.split(","))
    k = args.speculative_k if args.speculative_k == "auto" else int(args.speculative_k)
    modes = args.prefill.split(",")
    prompts = make_prompts(tokenizer(), args.requests * (args.repeats + 1), lens=lens, seed=0)
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    engines = {mode: Engine(model, slots=args.concurrency, max_len=lens[1] + args.max_tokens, speculative_k=k,
                            concurrent_prefill=PREFILL[mode]).start() for mode in modes}
    profiles = {mode: Profile(engine) for mode, engine in engines.items()}
    for engine in engines.values():  # warm-up, untimed
        closed_loop(engine, prompts[:args.concurrency], args.concurrency, args.max_tokens)
    runs = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        batch = prompts[args.requests * (repeat + 1):args.requests * (repeat + 2)]
        for mode, engine in engines.items():
            profiles[mode].reset()
            rounds_before = sum(engine.rounds_by_k.values())
            seconds, tokens = closed_loop(engine, batch, args.concurrency, args.max_tokens)
            runs[mode].append(summary(seconds, tokens, profiles[mode], sum(engine.rounds_by_k.values()) - rounds_before))
            r = runs[mode][-1]
            print(f"repeat {repeat}, prefill {mode}: {r['tokens_per_second']:.0f} tok/s; {r['seconds']:.2f} s: prefill "
                  f"{r['prefill_seconds']:.2f} s, decode {r['decode_seconds']:.2f} s in {r['segments']} segments of "
                  f"{r['rounds']} rounds; live rows {r['live_rows_by_time']:.1f}, bucket {r['bucket_by_time']:.1f} "
                  "(by time)", flush=True)
    for engine in engines.values():
        engine.shutdown()
    medians = {mode: statistics.median(r["tokens_per_second"] for r in runs[mode]) for mode in modes}
    print("median tok/s over", args.repeats, "repeats:", ", ".join(f"prefill {m} {v:.0f}" for m, v in medians.items()))
    if args.json:
        figures = {"settings": {name: value for name, value in vars(args).items() if name != "json"},
                   "median_tokens_per_second": medians,
                   "runs": {mode: [{name: value for name, value in r.items() if name != "segment_log"} for r in rs]
                            for mode, rs in runs.items()}}
        provenance.write(args.json, "engine_profile", figures,
                         {"segment_logs": {mode: [r["segment_log"] for r in rs] for mode, rs in runs.items()}},
                         args.repeats, prompts_sha256=data.prompts_sha256())


if __name__ == "__main__":
    main()

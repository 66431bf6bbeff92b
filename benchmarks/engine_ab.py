"""Serving engines of several speculation settings in one process, side by side: closed-loop at one
concurrency, in short phases whose order rotates, so that slow drift of a shared machine falls on
every setting alike.

benchmarks/serving.py measures the server as a client sees it, but its phases of one setting vary
by 10% or more on a shared CPU, more than the few percent that decide whether auto keeps up with
plain decoding where it decodes plainly. Here each phase sends --requests held-out prompts (each
cut to a seeded length of 32..--max-prompt tokens) to one engine, --concurrency at a time, every
engine the same prompts in the same phase. Printed: each setting's median tokens/s, the median of
its per-phase ratios to the first setting with a bootstrap 90% interval, its rounds by k, and the
segments it ran in each batch bucket beside the round costs it calibrated for each (the costs that
choose the bucket: every engine calibrates its own).

Two identical engines in one process are not alike to the percent: with --control (a second engine
of the first setting, created last, running the same compiled programs on buffers of its own) the
control served up to a few percent fewer tokens per second than the first setting's engine, at
concurrency 1 more than at 16; why is not established. A difference between settings means
something only beside the control's, and in both creation orders (--created reversed makes the
last setting's engine first).

    python benchmarks/engine_ab.py [--configs 0,auto] [--concurrency 1] [--phases 30]
        [--requests 12] [--max-tokens 96] [--slots 8] [--control] [--created given|reversed]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import statistics
import time

import numpy as np


def phase_rate(engine, prompts: list[list[int]], *, concurrency: int, max_tokens: int) -> float:
    """Output tokens per second of one engine over `prompts`, `concurrency` requests at a time."""
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(lambda p: engine.generate([p], max_tokens=max_tokens)[0], prompts))
    return sum(map(len, outputs)) / (time.perf_counter() - began)


def control_name(reference: str) -> str:
    """The name --control gives the second engine of the reference setting (render.py reads it)."""
    return f"{reference} (control)"


def paired(rates: dict[str, list[float]], name: str, reference: str, rng: np.random.Generator) -> dict:
    """The median of `name`'s per-phase ratios to `reference`'s, with a bootstrap 90% interval."""
    ratios = np.array(rates[name]) / np.array(rates[reference])
    medians = [np.median(rng.choice(ratios, len(ratios))) for _ in range(2000)]
    low, high = np.percentile(medians, [5, 95])
    return {"median": float(np.median(ratios)), "interval_90": [float(low), float(high)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="0,auto", help="speculative_k of each engine; ratios are to the first")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--phases", type=int, default=30, help="phases per engine")
    parser.add_argument("--requests", type=int, default=12, help="requests per phase")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-prompt", type=int, default=400, help="longest prompt in tokens (shortest 32)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control", action="store_true",
                        help="also a second engine of the first setting, created last: the harness's own A/A ratio")
    parser.add_argument("--created", choices=("given", "reversed"), default="given",
                        help="the order the engines are created in (ratios are to the first setting either way)")
    parser.add_argument("--json", help="write the figures and per-phase rates, with their provenance, here")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    import jaxmtp
    from jaxmtp import data
    from jaxmtp.engine import Engine
    from jaxmtp.provenance import write

    from jaxmtp.cli import _k_value  # the CLI's --k: "auto" or 0..MAX_SPECULATIVE_K, with its message

    try:
        configs = [_k_value(c) for c in args.configs.split(",")]
    except argparse.ArgumentTypeError as error:
        parser.error(f"--configs: {error}")
    names = [str(c) for c in configs]
    if len(set(names)) != len(names) or len(names) < 2:
        parser.error(f"--configs: expected two or more distinct settings, found {args.configs}")
    settings = dict(zip(names, configs))
    created = names[::-1] if args.created == "reversed" else list(names)
    if args.control:
        control = control_name(names[0])
        settings[control] = configs[0]
        names.append(control)
        created.append(control)
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    tokenizer = Tokenizer.from_file(f"{jaxmtp.DEMO_MODEL}/tokenizer.json")
    engines = {}
    for name in created:
        print(f"starting the engine {name} (speculative_k={settings[name]})", flush=True)
        engines[name] = Engine(model, tokenizer=tokenizer, slots=args.slots, max_len=args.max_len,
                               speculative_k=settings[name], progress=lambda message: None).start()
    rng = np.random.default_rng(args.seed)
    texts = data.held_out_prompts(tokenizer, 4 * args.requests, args.max_prompt)
    prompts = [list(t[:int(rng.integers(32, args.max_prompt + 1))]) for t in texts]
    for engine in engines.values():  # untimed: each program's first run
        phase_rate(engine, prompts[:args.concurrency], concurrency=args.concurrency, max_tokens=args.max_tokens)
    rates = {name: [] for name in names}
    # Each engine's bucket choices and the calibrated costs they follow (a round's milliseconds at each
    # of the engine's k, per bucket, from calibration's first position): every engine calibrates apart.
    before = {name: collections.Counter(engine.segments_by_bucket) for name, engine in engines.items()}
    round_ms = {name: {"ks": list(engine.ks), "by_bucket": {str(b): [round(1e3 * float(x), 3) for x in c[0]]
                                                            for b, c in engine.costs["greedy"].items()}}
                for name, engine in engines.items()}
    try:
        for i in range(args.phases):
            start = (i * args.requests) % len(prompts)
            mine = (prompts + prompts)[start:start + args.requests]
            for name in names[i % len(names):] + names[:i % len(names)]:
                rates[name].append(phase_rate(engines[name], mine, concurrency=args.concurrency,
                                              max_tokens=args.max_tokens))
            print(f"phase {i}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names) + " tokens/s", flush=True)
    finally:
        rounds = {name: {str(k): int(v) for k, v in engine.rounds_by_k.items() if v} for name, engine in engines.items()}
        segments = {name: engine.segments_by_bucket - before[name] for name, engine in engines.items()}
        for engine in engines.values():
            engine.shutdown(timeout=10)
    figures = {"concurrency": args.concurrency, "phases": args.phases, "requests_per_phase": args.requests,
               "max_tokens": args.max_tokens, "prompt_lens": [32, args.max_prompt], "slots": args.slots,
               "max_len": args.max_len, "reference": names[0], "created": created,
               "tokens_per_s": {n: statistics.median(v) for n, v in rates.items()},
               "paired": {n: paired(rates, n, names[0], rng) for n in names[1:]}, "rounds_by_k": rounds,
               "segments_by_bucket": {n: {str(b): c[b] for b in sorted(c)} for n, c in segments.items()},
               "calibrated_round_ms": round_ms}
    print("median tokens/s: " + ", ".join(f"{n} {v:.1f}" for n, v in figures["tokens_per_s"].items()))
    for n, p in figures["paired"].items():
        print(f"{n} / {names[0]}: median of {args.phases} paired ratios {p['median']:.3f} "
              f"(90% interval {p['interval_90'][0]:.3f}..{p['interval_90'][1]:.3f}); rounds by k {rounds[n]}")
    for n in names:
        print(f"{n}: segments by bucket {figures['segments_by_bucket'][n]}; calibrated round (ms at k = "
              f"{', '.join(map(str, round_ms[n]['ks']))}) by bucket {round_ms[n]['by_bucket']}")
    if args.json:
        write(args.json, "engine_ab", figures, {"tokens_per_s": rates}, args.phases,
              prompts_sha256=data.prompts_sha256())


if __name__ == "__main__":
    main()

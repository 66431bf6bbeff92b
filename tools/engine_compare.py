"""This tree's decode engine against an earlier commit's, side by side on the same machine.

Each engine runs in its own worker process (its own `import jaxmtp`); both load the demo model,
compile generation for the same held-out prompts (batch 1, greedy, each prompt alone), and then
run on command, alternately, so that drifts of a shared machine hit both alike. Printed per k:
the median tokens/s of each engine over --repeats runs, total (with each prompt's prefill) and
decode only (the prefill timed apart with max_new_tokens=1 and subtracted), and the ratio.
--forced times the loop of speculative_k="auto" with every round at each of --ks instead (both
trees need `Prepared.forced`).

    python tools/engine_compare.py [--base REV] [--ks 0,2] [--repeats 7] [--prompts 8] [--forced]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

from alternate import ROOT, ask, checkout, serve, start_worker, stop


def worker(prompt_count: int, prompt_len: int, max_new_tokens: int, ks: list[int], forced: bool):
    """Answers "run K" lines on stdin with one JSON line: seconds for all prompts, new tokens,
    and the prefill-only seconds."""
    import jax
    import jaxmtp
    from jaxmtp import data, generation
    from tokenizers import Tokenizer

    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    # The parts, not data.held_out_prompts: an earlier tree's jaxmtp runs this too.
    prompts = data.prompts_from(data.encode(tokenizer, data.read(data.source_files()[1])), prompt_count, prompt_len)

    def compiled(k, new):
        """Per prompt: (run the compiled loop, its new-token count from what it returns)."""
        if hasattr(getattr(generation, "Prepared", None), "run"):  # this tree: Prepared runs the compiled loop
            runs = []
            for p in prompts:
                if forced:
                    prepared = generation.prepare(model, [p], max_new_tokens=new, speculative_k="auto")
                    run = partial(prepared.run, prepared.forced(k, new))
                else:
                    prepared = generation.prepare(model, [p], max_new_tokens=new, speculative_k=k)
                    prepared = generation.calibrated(prepared)
                    run = prepared.run
                jax.block_until_ready(prepared.run(prepared.limited(1)))  # compiles, once per bucket
                runs.append((run, lambda state: int(getattr(state, "tokens", state).count[0])))  # older trees: a flat state
            return runs
        runs, cache = [], {}  # an engine before `Prepared.run`: one jitted function over positional arguments
        for p in prompts:
            prepared = generation.prepare(model, [p], new, speculative_k=k)
            signature = (prepared.static, prepared.args[1].shape)  # one compile per bucket
            if signature not in cache:
                cache[signature] = generation._generate.lower(prepared.static, *prepared.args).compile()
            runs.append((lambda fn=cache[signature], args=prepared.args: fn(*args), lambda out: int(out[1][0])))
        return runs

    def seconds(runs):
        start = time.perf_counter()
        outs = [jax.block_until_ready(run()) for run, _ in runs]
        return time.perf_counter() - start, [count(out) for out, (_, count) in zip(outs, runs)]

    full = {k: compiled(k, max_new_tokens) for k in ks}
    first = {k: compiled(k, 1) for k in ks}

    def answer(request):
        k = int(request.split()[1])
        total, counts = seconds(full[k])
        prefill, _ = seconds(first[k])
        return {"seconds": total, "prefill_seconds": prefill, "tokens": sum(counts), "prompts": len(prompts)}

    serve(answer)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (HEAD: the uncommitted changes)")
    parser.add_argument("--ks", default="0")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--forced", action="store_true", help="the auto loop with every round at k")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.worker:
        return worker(args.prompts, args.prompt_len, args.max_new_tokens, ks, args.forced)
    worker_args = ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
                   "--max-new-tokens", str(args.max_new_tokens), "--ks", args.ks] + ["--forced"] * args.forced
    with checkout(args.base) as base_tree:
        engines = {"base": start_worker(__file__, base_tree, worker_args),
                   "this": start_worker(__file__, ROOT, worker_args)}
        runs = {(name, k): [] for name in engines for k in ks}
        for _ in range(args.repeats):
            for k in ks:
                for name, proc in engines.items():
                    runs[name, k].append(ask(proc, f"run {k}"))
        stop(engines.values())
    loop = "the auto loop, every round at k" if args.forced else "the loop for k"
    print(f"demo model, {loop}, {args.prompts} held-out prompts of {args.prompt_len} tokens, batch 1, greedy, "
          f"{args.max_new_tokens} new tokens; median of {args.repeats} alternating runs; base = {args.base}")
    print(f"{'k':>2} {'engine':>6} {'tokens/s':>9} {'decode tok/s':>13}")
    for k in ks:
        rates = {}
        for name in engines:
            r = runs[name, k]
            total = statistics.median(x["tokens"] / x["seconds"] for x in r)
            decode = statistics.median((x["tokens"] - x["prompts"]) / (x["seconds"] - x["prefill_seconds"]) for x in r)
            rates[name] = (total, decode)
            print(f"{k:>2} {name:>6} {total:>9.1f} {decode:>13.1f}")
        print(f"{k:>2} {'ratio':>6} {rates['this'][0] / rates['base'][0]:>8.2f}x "
              f"{rates['this'][1] / rates['base'][1]:>12.2f}x")


if __name__ == "__main__":
    main()

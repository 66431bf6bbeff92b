"""`generate(..., speculative_k="auto")` against `speculative_k=0` as a user calls them: one call per
held-out prompt, the two settings alternating prompt by prompt, every call timed whole (checks,
padding, the loop, unpacking), after one untimed call of each that compiles and calibrates.

Auto must cost nothing where speculation cannot pay: where no k > 0 pays at the prior's acceptance
at this machine's calibrated round costs, auto runs the plain loop. --costs forces the round costs
(k = 0..3 in plain steps, 0..2 on a CPU, e.g. 1.1,1.85,2.3) to measure that case on a machine where
drafting pays.

    python benchmarks/auto_vs_plain.py [--prompts 8] [--max-new-tokens 64] [--repeats 5]
        [--costs C0,..,C3] [--json benchmarks/results/auto_vs_plain.json]
"""

import argparse
import os
import statistics
import tempfile
import time

import jaxmtp
from jaxmtp import calibration, data
from jaxmtp.provenance import write


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--costs",
                        help="force these round costs (k = 0..3, 0..2 on a CPU; plain steps) instead of calibrating")
    parser.add_argument("--json", help="write the figures and raw times, with their provenance, here")
    args = parser.parse_args()
    if args.costs:
        forced = [float(c) for c in args.costs.split(",")]
        os.environ["JAXMTP_CACHE_DIR"] = tempfile.mkdtemp()  # no stored costs: `measure` runs, and is replaced
        calibration.measure = lambda *_: forced
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    prompts = data.held_out_prompts(tokenizer, args.prompts, args.prompt_len)
    settings = {"plain": 0, "auto": "auto"}
    call = lambda k, p: jaxmtp.generate(model, [p], max_new_tokens=args.max_new_tokens, speculative_k=k,  # noqa: E731
                                        eos_token_id=None)
    first = {name: call(k, prompts[0]) for name, k in settings.items()}  # compiles (and calibrates)
    seconds = {name: [] for name in settings}
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = list(settings.items())[(repeat + i) % 2:] + list(settings.items())[:(repeat + i) % 2]
            for name, k in order:
                start = time.perf_counter()
                call(k, prompt)
                seconds[name].append(time.perf_counter() - start)
    per_repeat = {name: [sum(s[r * len(prompts):(r + 1) * len(prompts)]) for r in range(args.repeats)]
                  for name, s in seconds.items()}
    ratio = statistics.median(p / a for p, a in zip(per_repeat["plain"], per_repeat["auto"]))
    stats = first["auto"].stats
    figures = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "costs_forced": bool(args.costs),
               "round_costs": list(stats.round_costs), "auto_chose_plain": stats.chose_plain,
               "auto_rounds_by_k": {str(k): n for k, n in stats.rounds_by_k.items()},
               "plain_tokens_per_s": len(prompts) * args.max_new_tokens / statistics.median(per_repeat["plain"]),
               "auto_tokens_per_s": len(prompts) * args.max_new_tokens / statistics.median(per_repeat["auto"]),
               "auto_over_plain": ratio}
    print(f"round costs k = 0..: {' '.join(f'{c:.2f}' for c in stats.round_costs)}"
          f"{' (forced)' if args.costs else ''}; auto chose {'plain decoding' if stats.chose_plain else 'to draft'}; "
          f"auto / plain tokens/s = {ratio:.3f} (median over {args.repeats} repeats of {len(prompts)} calls each)")
    if args.json:
        write(args.json, "auto_vs_plain", figures, {"seconds": seconds}, args.repeats,
              prompts_sha256=data.prompts_sha256())


if __name__ == "__main__":
    main()

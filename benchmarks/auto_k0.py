"""What a round of the auto loop at k = 0 costs against a step of the plain decoding loop.

Where drafting pays at the prior, speculative_k="auto" runs its own loop, and its stretches of low
acceptance run at k = 0, which compile to the plain step's kernels plus the loop's bookkeeping (the
segment loops, the window of main hidden states, the acceptance counts); where no k pays, auto
runs the plain loop instead, because of this cost. For the demo model and the README's
prompt (or, with --prompt-len, the first held-out prompt of that many tokens, as `jaxmtp bench`
takes them), greedy, each --batch and --new-tokens: the plain loop and the auto loop with every round
forced to k = 0, each timed after an untimed prefill, alternating --pairs times; printed: the
median of the pairs' time ratios (auto / plain) with its quartiles. Calibration measures the same
ratio (its cost at k = 0) over 48 rounds per repeat.

    python benchmarks/auto_k0.py [--batch 1,4] [--new-tokens 64,400] [--pairs 15] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import os
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--new-tokens", default="64,400")
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--prompt-len", type=int, default=0, help="0: the README's prompt")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    import jaxmtp
    from jaxmtp import data
    from jaxmtp.generation import prepare, seconds_per_round

    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    prompt = tokenizer.encode("def fibonacci(n):").ids
    if args.prompt_len:
        prompt = data.held_out_prompts(tokenizer, 1, args.prompt_len)[0]
    for batch in map(int, args.batch.split(",")):
        for new in map(int, args.new_tokens.split(",")):
            auto = prepare(model, [prompt] * batch, max_new_tokens=new, speculative_k="auto", eos_token_id=None)
            plain = auto.plain()
            runs = ((auto, auto.forced(0, new)), (plain, plain.forced(0, new)))
            for run in runs:  # compiles
                seconds_per_round(*run)
            ratios = []
            for pair in range(args.pairs):
                seconds = {i: seconds_per_round(*runs[i]) for i in ((1, 0) if pair % 2 else (0, 1))}  # in turn
                ratios.append(seconds[0] / seconds[1])
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            print(f"batch {batch}, {len(prompt)}-token prompt, {new} new tokens: a round of the auto loop at k = 0 "
                  f"costs {median:.3f} [{q1:.3f}-{q3:.3f}] plain steps ({args.pairs} alternating pairs)", flush=True)


if __name__ == "__main__":
    main()

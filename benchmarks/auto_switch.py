"""What rounds at k = 0 leave behind for the speculative rounds of speculative_k="auto" after them.

A round at k = 0 drafts nothing and writes nothing into the MTP cache. For held-out prompts of the
demo model (batch 1, greedy), the auto loop first runs --plain-segments segments with every round
at k = 0 (8 rounds each), or a third as many at k = 3 (about as many tokens), and then 3 segments
at k = 3; printed: the acceptance of those last 24 rounds' drafts after each start. The two
starts leave the rounds at different positions of the text, which changes acceptance too; what
plain rounds leave behind (the MTP slots they did not write, a first draft made for an earlier
position) is measured by the same start in two trees: --tree measures another checkout's jaxmtp.

    python benchmarks/auto_switch.py [--plain-segments 6] [--prompts 8] [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import sys


def acceptance_after(model, prompts, first_k: int, first_segments: int) -> float:
    """Accepted / drafted over 3 segments at k = 3 that follow first_segments segments at first_k."""
    import jax.numpy as jnp
    from jaxmtp.decoding import advance, start
    from jaxmtp.generation import prepare

    accepted = drafted = 0
    for prompt in prompts:
        prepared = prepare(model, [prompt], max_new_tokens=200, speculative_k="auto")
        static, params, inputs = prepared.static, prepared.params, prepared.inputs
        halt = jnp.zeros_like(inputs.real)
        state = start(static, params, inputs)
        for k, segments in ((first_k, first_segments), (3, 3)):
            before = int(state.accepted[0]), int(state.drafted[0])
            state = advance(static, params, state, inputs.replace(force_k=jnp.int32(k)), jnp.int32(segments), halt)[0]
        accepted += int(state.accepted[0]) - before[0]
        drafted += int(state.drafted[0]) - before[1]
    return accepted / drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plain-segments", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tree", help="a checkout whose jaxmtp to measure (default: the installed one)")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    import jaxmtp
    from jaxmtp import data
    from tokenizers import Tokenizer

    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    tokenizer = Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))
    prompts = data.prompts_from(data.encode(tokenizer, data.read(data.source_files()[1])), args.prompts, 32)
    print(f"{jaxmtp.__file__}: acceptance of 3 segments at k = 3 (24 rounds per prompt, {args.prompts} prompts)")
    for k, segments in ((0, args.plain_segments), (3, max(1, args.plain_segments // 3))):
        rate = acceptance_after(model, prompts, k, segments)
        print(f"after {segments} segments at k = {k}: {rate:.3f}")


if __name__ == "__main__":
    main()

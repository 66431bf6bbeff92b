"""speculative_k="auto" where speculation cannot pay: the demo model with its MTP layer broken.

The MTP layer's input projection (`eh_proj`) gets its columns permuted, so that its drafts are
almost never accepted (0.2-2% at the first position) while the main model is the demo's. Then
`jaxmtp bench` on it, with its calibration in a new directory: plain decoding, k = 1..4 and
auto, on held-out prompts (greedy, batch 1). Auto should cost at most a few percent against plain
decoding: it runs its own loop at k = 0 once the counts say no k pays, and what it pays is the
exploring at the start of each call (see jaxmtp.adaptive).

    python benchmarks/useless_mtp.py [--prompts 4] [--max-new-tokens 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile


def broken_copy(directory: str) -> str:
    """The demo model with a permuted eh_proj, saved with its tokenizer under `directory`."""
    import jax.numpy as jnp
    import numpy as np

    import jaxmtp

    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    mtp = dict(model.params["mtp"])
    weight = np.asarray(mtp["eh_proj"]["weight"])
    mtp["eh_proj"] = {"weight": jnp.asarray(np.random.default_rng(0).permutation(weight, axis=1))}
    path = os.path.join(directory, "useless_mtp")
    jaxmtp.save(jaxmtp.Model(model.config, {**model.params, "mtp": mtp}), path)
    shutil.copy(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from jaxmtp.cli import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        path = broken_copy(tmp)
        os.environ["JAXMTP_CACHE_DIR"] = os.path.join(tmp, "cache")  # a calibration of its own
        cli(["bench", "--model", path, "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
             "--repeats", str(args.repeats)])


if __name__ == "__main__":
    main()

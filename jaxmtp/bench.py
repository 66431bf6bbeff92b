"""Plain vs MTP speculative decoding on the same model and prompts, measured side by side.

Each prompt runs alone (batch 1), greedy, through the compiled generation loop; compile time is
excluded and each configuration's time is the median over repeats of the summed prompt times.
"""

from __future__ import annotations

import statistics
import time

import jax

from jaxmtp.generation import _generate, prepare, unpack
from jaxmtp.model import Model


def run(model: Model, prompts: list[list[int]], ks=(1, 2, 3, 4), max_new_tokens: int = 64, repeats: int = 3,
        eos_token_id: int | None = None) -> list[dict]:
    """One row per k (k = 0 first): tokens/s, speedup over k = 0, acceptance figures.

    Every configuration is compiled and run once first; then the timed repeats go round all k in
    turn, so that slow drifts of a shared machine hit every k alike. Raises AssertionError if any
    speculative output differs from plain greedy decoding.
    """
    ks = (0, *ks)
    prepared = {k: [prepare(model, [p], max_new_tokens, speculative_k=k, eos_token_id=eos_token_id) for p in prompts]
                for k in ks}
    seconds = {k: [] for k in ks}
    with model.mesh_context():
        outputs = {k: [unpack(p, jax.block_until_ready(_generate(p.static, *p.args))) for p in prepared[k]]
                   for k in ks}
        for _ in range(repeats):
            for k in ks:
                start = time.perf_counter()
                for p in prepared[k]:
                    jax.block_until_ready(_generate(p.static, *p.args))
                seconds[k].append(time.perf_counter() - start)
    rows = []
    for k in ks:
        tokens = [out.tokens[0] for out in outputs[k]]
        assert tokens == [out.tokens[0] for out in outputs[0]], f"k={k}: speculative output differs from plain greedy"
        stats = [out.stats for out in outputs[k]]
        drafted = sum(s["draft_tokens"] for s in stats)
        accepted = sum(s["accepted_tokens"] for s in stats)
        rounds = [s["main_forward_passes"] - 1 for s in stats]
        at = [sum(s["per_position_acceptance"][i] * r for s, r in zip(stats, rounds)) for i in range(k)]
        new = sum(len(t) for t in tokens)
        tps = new / statistics.median(seconds[k])
        rows.append({"k": k, "tokens_per_s": tps, "speedup": tps / rows[0]["tokens_per_s"] if rows else 1.0,
                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                     "mean_accepted_length": 1 + accepted / sum(rounds) if sum(rounds) else 1.0,
                     "per_position_acceptance": [a / sum(rounds) for a in at] if sum(rounds) else [],
                     "main_forward_passes": sum(rounds) + len(prompts), "new_tokens": new})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'k':>2} {'tokens/s':>9} {'speedup':>8} {'accept':>7} {'mean len':>9} {'passes':>7}  per-position acceptance"]
    for r in rows:
        per_position = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        lines.append(f"{r['k']:>2} {r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x {r['acceptance_rate']:>7.3f} "
                     f"{r['mean_accepted_length']:>9.2f} {r['main_forward_passes']:>7}  {per_position}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str | None = None):
    """Acceptance by draft position (one line per k) and speedup by k. Needs matplotlib."""
    try:
        import matplotlib
        if path:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows[1:]:
        left.plot(range(1, r["k"] + 1), r["per_position_acceptance"], marker="o", label=f"k={r['k']}")
    left.set(xlabel="draft position", ylabel="acceptance", title="Acceptance by draft position", ylim=(0, 1))
    left.legend()
    right.bar([str(r["k"]) for r in rows], [r["speedup"] for r in rows])
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(xlabel="k (0 = plain)", ylabel="tokens/s relative to plain", title="Speedup by k")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig

"""Plain vs MTP speculative decoding (fixed k and auto) on the same model and prompts, side by side.

Each prompt runs alone (batch 1), greedy, through the compiled generation loop; compile time is
excluded and each configuration's time is the median over repeats of the summed prompt times. The
prefill of each prompt is also timed alone (the same loop with max_new_tokens=1), so that
decode-only rates, which the prefill does not pull towards 1, are reported beside the totals.
"""

from __future__ import annotations

import statistics
import time

import jax

from jaxmtp.generation import Prepared, calibrated, prepare, unpack
from jaxmtp.model import Model


def _prepared(model: Model, prompts, k, max_new_tokens, eos_token_id) -> list[Prepared]:
    """A prepared run per prompt, compiled (one compile per bucket) and with auto calibrated."""
    runs = []
    for p in prompts:
        prepared = calibrated(prepare(model, [p], max_new_tokens=max_new_tokens, speculative_k=k,
                                      eos_token_id=eos_token_id))
        jax.block_until_ready(prepared.run(prepared.limited(1)))
        runs.append(prepared)
    return runs


def _seconds(prepared: Prepared, prefill_only: bool = False) -> float:
    inputs = prepared.limited(1) if prefill_only else None  # built before the clock starts
    start = time.perf_counter()
    jax.block_until_ready(prepared.run(inputs))
    return time.perf_counter() - start


def run(model: Model, prompts: list[list[int]], ks=(1, 2, 3, 4), max_new_tokens: int = 64, repeats: int = 3,
        eos_token_id: int | None = None, auto: bool = True) -> list[dict]:
    """One row per configuration: k = 0 first, then `ks`, then "auto": tokens/s (total and decode
    only; medians), speedups over k = 0 (the median of each repeat's ratio), acceptance figures,
    the round cost in plain steps (from the calibration that auto uses), the ideal speedup that
    the measured acceptance and costs allow (mean accepted length / round cost; for auto, the best
    of the fixed k), and achieved / ideal. Auto's row also holds the calibrated costs it chose from
    ("round_costs", k = 0..generation.auto_max_k in plain steps) and its time against the fastest of plain and
    the fixed k ("best", "decode_best": that k, by speedup and by decode speedup; "vs_best",
    "decode_vs_best": the median over repeats of that k's seconds / auto's).

    Every configuration is compiled and run once first. In each timed repeat every prompt runs in
    every configuration in turn, the order rotated from one prompt to the next, so that each
    configuration's runs of a prompt lie within a fraction of a second of each other and a shared
    machine's slower spells, which last a tenth of a second to seconds, weigh on all of them alike;
    a repeat's time for a configuration is the sum over the prompts, and a speedup pairs the times
    of one repeat. Raises AssertionError if any speculative output differs from plain greedy
    decoding.
    """
    configs = [0, *ks] + (["auto"] if auto and model.config.has_mtp else [])
    totals = {k: [0.0] * repeats for k in configs}
    prefill_seconds = {k: [0.0] * repeats for k in configs}
    with model.mesh_context():
        runs = {k: _prepared(model, prompts, k, max_new_tokens, eos_token_id) for k in configs}
        outputs = {k: [unpack(p, p.run()) for p in runs[k]] for k in configs}
        for repeat in range(repeats):
            for i in range(len(prompts)):
                turn = (repeat + i) % len(configs)
                for k in configs[turn:] + configs[:turn]:
                    totals[k][repeat] += _seconds(runs[k][i])
                    prefill_seconds[k][repeat] += _seconds(runs[k][i], prefill_only=True)
    costs = _round_costs(runs)
    rows = [_row(k, outputs[k], outputs[0], totals[k], prefill_seconds[k], len(prompts), costs) for k in configs]
    decode_seconds = {k: [t - p for t, p in zip(totals[k], prefill_seconds[k])] for k in configs}
    for r, k in zip(rows, configs):  # the same tokens (asserted): time ratios are rate ratios
        r["seconds"], r["prefill_seconds"] = totals[k], prefill_seconds[k]  # each repeat's, all prompts
        r["speedup"] = _paired_speedup(totals[0], totals[k])
        r["decode_speedup"] = _paired_speedup(decode_seconds[0], decode_seconds[k])
    fixed = [r for r in rows if r["k"] != "auto"]
    for r in rows:
        if r["k"] == "auto":
            best = max(fixed, key=lambda f: f["speedup"])["k"]
            decode_best = max(fixed, key=lambda f: f["decode_speedup"])["k"]
            ideals = [f["ideal_speedup"] for f in fixed if f["ideal_speedup"] is not None]
            r.update(ideal_speedup=max(ideals), round_costs=costs, best=best,
                     vs_best=_paired_speedup(totals[best], totals["auto"]), decode_best=decode_best,
                     decode_vs_best=_paired_speedup(decode_seconds[decode_best], decode_seconds["auto"]))
        # (a fixed k past auto's largest has no calibrated cost, so no ideal)
        r["achieved_over_ideal"] = r["decode_speedup"] / r["ideal_speedup"] if r["ideal_speedup"] else None
    return rows


def _paired_speedup(base: list[float], other: list[float]) -> float:
    """The median over repeats of the base configuration's seconds / the other's."""
    return statistics.median(p / max(o, 1e-9) for p, o in zip(base, other))


def _round_costs(runs) -> list[float] | None:
    """The calibrated round costs of the auto runs (k = 0..generation.auto_max_k), if auto ran."""
    return runs["auto"][0].costs if "auto" in runs else None


def _row(k, outputs, plain, totals, prefills, prompt_count, costs) -> dict:
    tokens = [out.tokens[0] for out in outputs]
    assert tokens == [out.tokens[0] for out in plain], f"k={k}: speculative output differs from plain greedy"
    stats = [out.stats for out in outputs]
    drafted = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    rounds = sum(s.main_forward_passes - 1 for s in stats)
    by_k = {}
    for s in stats:
        for j, n in s.rounds_by_k.items():
            by_k[j] = by_k.get(j, 0) + n
    k_max = max(by_k) if by_k else 0
    drafting = [_drafting(by_k, i) for i in range(k_max)]
    # accepted counts of draft i+1 back from each prompt's share of the rounds that drafted it
    at = [sum(s.per_position_acceptance[i] * _drafting(s.rounds_by_k, i)
              for s in stats if i < len(s.per_position_acceptance)) for i in range(k_max)]
    new = sum(len(t) for t in tokens)
    total, prefill = statistics.median(totals), statistics.median(prefills)
    mean_length = 1 + accepted / rounds if rounds else 1.0
    # the plain loop is the unit; a fixed k is costed by the auto loop's round at that k
    cost = 1.0 if k == 0 else costs[k] if costs is not None and isinstance(k, int) and k < len(costs) else None
    return {"k": k, "tokens_per_s": new / total, "decode_tokens_per_s": (new - prompt_count) / max(total - prefill, 1e-9),
            "acceptance_rate": accepted / drafted if drafted else 0.0, "mean_accepted_length": mean_length,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(at, drafting)],
            "rounds_by_k": dict(sorted(by_k.items())), "round_cost": cost,
            "ideal_speedup": mean_length / cost if cost else None,
            "main_forward_passes": rounds + len(outputs), "new_tokens": new}


def _drafting(rounds_by_k: dict, i: int) -> int:
    """Rounds that drafted i + 1 or more tokens."""
    return sum(n for k, n in rounds_by_k.items() if k > i)


def table(rows: list[dict]) -> str:
    lines = [f"{'k':>4} {'tokens/s':>9} {'speedup':>8} {'decode/s':>9} {'speedup':>8} {'cost':>5} {'accept':>7} "
             f"{'mean len':>8} {'ideal':>6} {'ach/ideal':>9}  rounds by k / per-position acceptance"]
    for r in rows:
        cost = f"{r['round_cost']:.2f}" if r["round_cost"] else "-"
        ideal = f"{r['ideal_speedup']:.2f}x" if r["ideal_speedup"] else "-"
        achieved = f"{r['achieved_over_ideal']:.2f}" if r["achieved_over_ideal"] is not None else "-"
        per_position = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        detail = per_position
        if r["k"] == "auto":
            costs = " ".join(f"{c:.2f}" for c in r["round_costs"])
            detail = f"costs {costs}; " + " ".join(f"k={j}:{n}" for j, n in r["rounds_by_k"].items()) + " / " + detail
        lines.append(f"{r['k']!s:>4} {r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x {r['decode_tokens_per_s']:>9.1f} "
                     f"{r['decode_speedup']:>7.2f}x {cost:>5} {r['acceptance_rate']:>7.3f} "
                     f"{r['mean_accepted_length']:>8.2f} {ideal:>6} {achieved:>9}  {detail}")
    for r in rows:
        if r["k"] == "auto":
            lines.append(f"auto against the fastest of the others (median of the repeats' paired ratios): "
                         f"{r['vs_best']:.2f}x k={r['best']}, "
                         f"decode only {r['decode_vs_best']:.2f}x k={r['decode_best']}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str | None = None):
    """Acceptance by draft position (one line per k) and decode speedup by k, auto marked. Needs
    matplotlib."""
    try:
        import matplotlib
        if path:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from e
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows[1:]:
        positions = range(1, len(r["per_position_acceptance"]) + 1)
        left.plot(positions, r["per_position_acceptance"], marker="o", label=f"k={r['k']}")
    max_k = max((len(r["per_position_acceptance"]) for r in rows), default=0)
    left.set_xticks(range(1, max_k + 1))  # draft positions are whole numbers
    left.set(xlabel="draft position", ylabel="acceptance", title="Acceptance by draft position", ylim=(0, 1.05))
    # below the axes: inside, it would cover the lines wherever they run
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=max(len(rows) - 1, 1), frameon=False)
    labels = [str(r["k"]) for r in rows]
    colors = ["tab:orange" if r["k"] == "auto" else "tab:blue" for r in rows]
    bars = right.bar(labels, [r["decode_speedup"] for r in rows], color=colors)
    right.bar_label(bars, fmt="%.2fx")  # a bar too short to see still shows its value
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set_ylim(0, 1.15 * max(r["decode_speedup"] for r in rows))
    right.set(xlabel="k (0 = plain)", ylabel="decode tokens/s relative to plain", title="Speedup by k (auto in orange)")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig

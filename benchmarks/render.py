"""Renders docs/performance.md and the README's results table from the results JSON in
benchmarks/results/ (each with its provenance), so that no figure in the docs is typed by hand.

    python benchmarks/render.py          # writes docs/performance.md and README.md's table
    python benchmarks/render.py --check  # exit status 1 if either is stale
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = os.path.join(ROOT, "docs", "performance.md")
README = os.path.join(ROOT, "README.md")
START, END = "<!-- results: rendered by benchmarks/render.py -->", "<!-- end of results -->"


def load(name: str) -> dict | None:
    path = os.path.join(RESULTS, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def source(result: dict, name: str) -> str:
    """Where a table's figures come from: the device, versions, date, command and repeats (the
    commit is in the JSON)."""
    p = result["provenance"]
    device = p["device"]
    where = device["kind"] if device["platform"] != "cpu" else f"CPU, {device.get('cpu_cores')} cores"
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if k in ("jax", "jaxlib", "flax"))
    flags = "; flags " + " ".join(f"{k}={v}" for k, v in sorted(p["flags"].items())) if p.get("flags") else ""
    return (f"*{where}; {versions}; {p['date'][:10]}; `{p['command']}`; {p['repeats']} repeats{flags}. "
            f"Source: [`benchmarks/results/{name}.json`](../benchmarks/results/{name}.json).*")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def bench_section(name: str, title: str) -> str:
    result = load(name)
    if result is None:
        return ""
    f = result["figures"]
    rows = []
    for r in f["rows"]:
        cost = "-" if r.get("round_cost") is None else f"{r['round_cost']:.2f}"
        rows.append([r["k"], f"{r['tokens_per_s']:.0f}", f"{r['decode_tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                     f"{r['decode_speedup']:.2f}x", f"{r['acceptance_rate']:.2f}", f"{r['mean_accepted_length']:.2f}",
                     cost])
    auto = next((r for r in f["rows"] if r["k"] == "auto"), None)
    note = ""
    if auto is not None:
        costs = " ".join(f"{c:.2f}" for c in auto["round_costs"]) if auto.get("round_costs") else "-"
        by_k = ", ".join(f"k = {k}: {n}" for k, n in auto["rounds_by_k"].items())
        note = (f"\n\nAuto's calibrated round costs (k = 0..{len(auto.get('round_costs') or [0]) - 1}, plain steps): "
                f"{costs}; its rounds: {by_k}; "
                f"auto ran at {auto['vs_best']:.2f}x the speed of the fastest setting (k = {auto['best']}).")
    return (f"### {title}\n\n{f['model']}, {f['prompts']}, batch 1, greedy, {f['max_new_tokens']} new tokens each; "
            f"medians; decode = without the prefill; cost = a round in plain steps.\n\n"
            + table(["k", "tokens/s", "decode tokens/s", "speedup", "decode speedup", "acceptance", "mean accepted",
                     "round cost"], rows) + note + "\n\n" + source(result, name) + "\n")


def auto_section() -> str:
    result = load("auto_vs_plain")
    if result is None:
        return ""
    f = result["figures"]
    costs = " ".join(f"{c:.2f}" for c in f["round_costs"])
    chose = "the plain loop" if f["auto_chose_plain"] else "to draft"
    return ("### Auto where speculation cannot pay\n\n"
            f"User-level `generate` calls, {f['prompts']} held-out prompts, {f['max_new_tokens']} new tokens, auto and "
            f"plain alternating. Round costs k = 0..{len(f['round_costs']) - 1} "
            f"{'(forced)' if f['costs_forced'] else '(calibrated)'}: {costs}; "
            f"auto chose {chose}.\n\n"
            + table(["plain tokens/s", "auto tokens/s", "auto / plain"],
                    [[f"{f['plain_tokens_per_s']:.0f}", f"{f['auto_tokens_per_s']:.0f}", f"{f['auto_over_plain']:.3f}"]])
            + "\n\n" + source(result, "auto_vs_plain") + "\n")


def decode_step_section() -> str:
    result = load("h200_decode_step")
    if result is None:
        return ""
    f = result["figures"]
    rows = [[p["rows"], f"{p['main_forward_us']:.1f}", f"{p['mtp_pass_us']:.1f}"] for p in f["passes"]]
    costs = ", ".join(f"k = {k}: {c:.2f}" for k, c in f["round_cost_by_k"].items())
    return ("### One decode step on an H200\n\nThe demo model's main forward and one MTP pass at T rows, microseconds "
            "per call (a jitted loop of calls, so dispatch is excluded).\n\n"
            + table(["rows", "main forward (us)", "MTP pass (us)"], rows)
            + f"\n\nA round at k in plain steps (these passes only): {costs}.\n\n"
            + source(result, "h200_decode_step") + "\n")


def sparse_section() -> str:
    parts = []
    for name, title in (("sparse_attention", "On this project's CPU"), ("h200_sparse_attention", "On an H200")):
        result = load(name)
        if result is None:
            continue
        rows = [[r["cached_tokens"], r["rows"], f"{r['v3_ms']:.3f}", f"{r['v32_ms']:.3f}", f"{r['v3_over_v32']:.2f}x"]
                for r in result["figures"]]
        parts.append(f"### {title}\n\n" + table(["cached tokens", "rows", "V3 (ms)", "V3.2 (ms)", "V3 / V3.2"], rows)
                     + "\n\n" + source(result, name) + "\n")
    if not parts:
        return ""
    return ("## DeepSeek-V3 against DeepSeek-V3.2 (sparse attention)\n\nThe main forward of one decode step (1 row) "
            "and one verify pass (4 rows, k = 3) at the same tiny widths, random weights, batch 1; V3.2's indexer "
            "selects 2048 keys (`benchmarks/sparse_attention.py`). At these widths a step on a GPU is bound by its "
            "kernel launches, not by reading the cache, so there the indexer's extra kernels (scoring, top-k, "
            "gather) cost more than the attention they save; the gain needs widths at which reading the cache "
            "dominates a step, as on the CPU.\n\n" + "\n".join(parts))


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def plans_section() -> str:
    result = load("plans")
    if result is None:
        return ""
    rows, fit = [], []
    for name, f in result["figures"].items():
        if name.startswith("fit_"):
            fit = f
            continue
        mesh = ",".join(f"{axis}={size}" for axis, size in f["mesh"].items() if size > 1)
        fits = ", ".join(device.split(" (")[0] for device, ok in f["fits"].items() if ok) or "none listed"
        rows.append([f["config"], mesh, f["batch"], f["cache_len"], f["prompt_len"], f["k"],
                     gb(f["parameter_bytes_per_device"]), gb(f["cache_bytes_per_device"]), gb(f["xla_temp_bytes"]),
                     gb(f["total_bytes_per_device"]), fits])
    text = ("## Memory at scale (`jaxmtp plan`)\n\nPer-device bytes of the whole generation program (chunked "
            "prefill + speculative loop), FP8 weights kept and multiplied by the W8A8 kernels, from XLA's memory "
            "analysis of an AOT compile for emulated devices (`benchmarks/plans.py`). CPU figures over-count a GPU's "
            "(see [large_models.md](large_models.md)).\n\n"
            + table(["config", "mesh", "batch", "cache", "prompt", "k", "params GB", "caches GB", "temporaries GB",
                     "total GB", "fits"], rows))
    if fit:
        fit_rows = [[f["batch"], f["cache_len"], gb(f["total_bytes_per_device"])] for f in fit]
        text += ("\n\nThe longest cache (and prompt as long) that fits an H200 (141 GB) on one node of 8, "
                 "DeepSeek-V3 671B, `data=8`:\n\n" + table(["batch", "cache tokens", "total GB"], fit_rows))
    return text + "\n\n" + source(result, "plans") + "\n"


def device_plan_section() -> str:
    result = load("h200_plan_device")
    if result is None:
        return ""
    d, cpu = result["figures"]["device_run"], result["figures"]["cpu_prediction"]
    rows = [["the device's measured peak (`memory_stats`)", gb(d["peak_bytes_in_use"])],
            ["XLA's analysis, compiled for the device", gb(d["predicted_total_bytes"])],
            ["`jaxmtp plan` on the CPU", gb(cpu["predicted_total_bytes"])]]
    return ("### The plan against a device\n\n"
            f"DeepSeek-V3 671B widths with {d['layers']} layers, random FP8 weights, batch {d['batch']}, cache "
            f"{d['cache_len']}, prompt {d['prompt_len']}, k = {d['k']}, one device "
            "(`benchmarks/plan_on_device.py`).\n\n" + table(["measure", "GB"], rows)
            + "\n\nThe CPU over-counts: XLA:CPU widens FP8 and bfloat16 operands and lowers the kernels in interpret "
              "mode; the device's own analysis matches its peak.\n\n" + source(result, "h200_plan_device") + "\n")


def cold_start_section() -> str:
    result = load("compile_cache")
    if result is None:
        return ""
    f = result["figures"]
    return ("## The first run\n\n`jaxmtp generate \"def fibonacci(n):\"` in a new process: with an empty cache "
            "(compiling the loops and measuring round costs), then with the cache that run left "
            "(`benchmarks/compile_cache.py`).\n\n"
            + table(["empty cache (s)", "warm cache (s)", "compile cache off (s)"],
                    [[f"{f['cold_s']:.1f}", f"{f['warm_s']:.1f}", f"{f['cache_off_s']:.1f}"]])
            + "\n\n" + source(result, "compile_cache") + "\n")


def page() -> str:
    parts = ["# Performance\n\nEvery figure here is rendered by `python benchmarks/render.py` from the results JSON in "
             "`benchmarks/results/`, which holds each run's provenance (commit, versions, device, flags, command, "
             "repeats, raw times). How to measure: [development.md](development.md).\n",
             "## Speculative decoding on the demo model\n",
             bench_section("bench_cpu", "On this project's CPU"), bench_section("h200_bench", "On an H200"),
             auto_section(), decode_step_section(), sparse_section(), plans_section(), device_plan_section(),
             cold_start_section()]
    return "\n".join(p for p in parts if p).rstrip() + "\n"


def readme_table() -> str:
    """The README's one results table: the demo's best k against plain, auto, per device."""
    rows = []
    for name, where in (("bench_cpu", "CPU"), ("h200_bench", "H200")):
        result = load(name)
        if result is None:
            continue
        by_k = {r["k"]: r for r in result["figures"]["rows"]}
        best = max((r for r in by_k.values() if r["k"] != "auto"), key=lambda r: r["speedup"])
        auto = by_k.get("auto")
        rows.append([where, f"{by_k[0]['tokens_per_s']:.0f}", f"k = {best['k']}: {best['speedup']:.2f}x",
                     "-" if auto is None else f"{auto['speedup']:.2f}x"])
    text = table(["demo model, batch 1", "plain tokens/s", "best fixed k", "auto"], rows)
    sparse = load("sparse_attention")
    if sparse is not None:
        longest = max(sparse["figures"], key=lambda r: (r["cached_tokens"], -r["rows"]))
        text += (f"\n\nDeepSeek-V3.2's sparse attention: a decode step at {longest['cached_tokens'] // 1024}K cached "
                 f"tokens {longest['v3_over_v32']:.2f}x as fast as V3's at the same tiny widths on the CPU")
        gpu = load("h200_sparse_attention")
        if gpu is not None:
            at = next(r for r in gpu["figures"] if (r["cached_tokens"], r["rows"]) == (longest["cached_tokens"], 1))
            text += f", {at['v3_over_v32']:.2f}x on an H200, where a step at these widths is launch-bound"
        text += "."
    return f"{START}\n{text}\n\nMore, with provenance: [docs/performance.md](docs/performance.md).\n{END}"


def readme(current: str) -> str:
    if START not in current:
        return current
    before, rest = current.split(START, 1)
    return before + readme_table() + rest.split(END, 1)[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md or the README is stale")
    args = parser.parse_args()
    with open(README) as f:
        current_readme = f.read()
    wanted = {PAGE: page(), README: readme(current_readme)}
    stale = []
    for path, text in wanted.items():
        existing = open(path).read() if os.path.exists(path) else None
        if existing != text:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(text)
    if args.check and stale:
        sys.exit(f"stale: {', '.join(stale)}; run python benchmarks/render.py")
    print(("stale: " if args.check else "rendered: ") + (", ".join(stale) or "nothing to change"))


if __name__ == "__main__":
    main()

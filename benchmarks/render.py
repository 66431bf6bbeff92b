"""Renders docs/performance.md and the README's results table from the results JSON in
benchmarks/results/ (each with its provenance), so that no figure in the docs is typed by hand.

Each footnote names the commit its figures were measured at (and whether the tree had uncommitted
changes), and says where the engine (jaxmtp/, pallas_kernels/) has changed since: by the engine's
hash where the result records one, else by git against that commit. A change to the engine can
thus make the page stale once per result; rendering again is part of such a change.

    python benchmarks/render.py          # writes docs/performance.md and README.md's table
    python benchmarks/render.py --check  # exit status 1 if either is stale
"""

import argparse
import collections
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from jaxmtp import data  # noqa: E402  (this checkout's, not an installed copy)
from jaxmtp.provenance import ENGINE, engine_sha256  # noqa: E402
from benchmarks.engine_ab import control_name, paired  # noqa: E402  (the benchmark's own names and statistic)

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


def engine_changed(p: dict) -> bool:
    """Whether the engine (ENGINE) in this checkout differs from the one the figures were measured
    on: by the engine hash the result records, else by git between the commit of the tree that ran
    (tree_commit, else commit) and the working tree, untracked files included."""
    if p.get("engine_sha256"):
        return p["engine_sha256"] != engine_sha256(ROOT)
    commit = p.get("tree_commit") or p["commit"]
    diff = subprocess.run(["git", "diff", "--quiet", commit, "--", *ENGINE], cwd=ROOT, capture_output=True)
    if diff.returncode not in (0, 1):
        raise LookupError(f"git cannot compare commit {commit} with this checkout ({diff.stderr.decode().strip()}): "
                          "rendering needs the commits the results name (a full clone, not a shallow one)")
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", *ENGINE], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    return diff.returncode == 1 or bool(untracked)


def measured_at(p: dict) -> str:
    """The commit the figures were measured at, its uncommitted-changes flag, the tree's commit where
    it was another, and whether the engine has changed since."""
    dirty = {True: "with uncommitted changes", False: "without uncommitted changes",
             None: "uncommitted changes not recorded"}[p["uncommitted_changes"]]
    tree = (f" (as the device's git named it; the files run were `{p['tree_commit'][:7]}`'s, see `tree_reason`)"
            if p.get("tree_commit") else "")
    since = "; the engine (`jaxmtp/`, `pallas_kernels/`) has changed since" if engine_changed(p) else ""
    return f"Measured at commit `{p['commit'][:7]}`{tree}, {dirty}{since}."


def prompts_label(result: dict, prompts) -> str:
    """`prompts` (a result's description or count of its prompts) with their text: the shipped
    held-out prompts by hash, or, for results that record none, the standard library they were cut
    from before the package shipped its prompts."""
    f, p = result["figures"], result["provenance"]
    sha = f.get("prompts_sha256") or p.get("prompts_sha256")
    if sha and f.get("prompts") == "--tokens":
        return f"prompts given as token ids (`jaxmtp bench --tokens`, sha256 `{sha[:12]}` of their JSON)"
    if sha:
        which = "" if sha == data.prompts_sha256() else "an earlier version of "
        return f"{prompts} ({which}`jaxmtp/benchmark_prompts.json`, sha256 `{sha[:12]}`)"
    if p.get("engine_sha256"):
        raise ValueError(f"a {result['benchmark']} result measured with the current provenance records no "
                         "prompts_sha256: pass data.prompts_sha256() to provenance.write")
    python = p["versions"].get("python")
    library = f"Python {python}'s" if python else "the measuring machine's Python's (its version not recorded)"
    return f"{prompts} cut from {library} standard library before the package shipped its prompts"


def source(result: dict, name: str) -> str:
    """Where a table's figures come from: the device, versions, date, command and repeats, and the
    commit (`measured_at`)."""
    p = result["provenance"]
    device = p["device"]
    where = device["kind"] if device["platform"] != "cpu" else f"CPU, {device.get('cpu_cores')} cores"
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items() if k in ("jax", "jaxlib", "flax"))
    flags = "; flags " + " ".join(f"{k}={v}" for k, v in sorted(p["flags"].items())) if p.get("flags") else ""
    return (f"*{where}; {versions}; {p['date'][:10]}; `{p['command']}`; {p['repeats']} repeats{flags}. "
            f"{measured_at(p)} Source: [`benchmarks/results/{name}.json`](../benchmarks/results/{name}.json).*")


def result_names(prefix: str) -> list[str]:
    """The names of benchmarks/results/{prefix}*.json, sorted, without the suffix."""
    return sorted(n.removesuffix(".json") for n in os.listdir(RESULTS) if n.startswith(prefix) and n.endswith(".json"))


def results_section(prefix: str, intro: str, render_one, key=None) -> str:
    """`intro` followed by render_one(result, name) of every benchmarks/results/{prefix}*.json (in
    the order of `key`, else by name), or nothing where there is none."""
    names = sorted(result_names(prefix), key=key)
    return intro + "\n".join(render_one(load(name), name) for name in names) if names else ""


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
    return (f"### {title}\n\n{f['model']}, {prompts_label(result, f['prompts'])}; batch 1, greedy, "
            f"{f['max_new_tokens']} new tokens each; medians; decode = without the prefill; cost = a round in plain "
            "steps.\n\n"
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
            f"User-level `generate` calls, {prompts_label(result, str(f['prompts']) + ' held-out prompts')}; "
            f"{f['max_new_tokens']} new tokens, auto and "
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


def family_section() -> str:
    result = load("family_step")
    if result is None:
        return ""
    rows = [[r["cached_tokens"], r["rows"], f"{r['v3_ms']:.3f}", f"{r['v32_ms']:.3f}", f"{r['v4_ms']:.3f}",
             f"{r['v3_ms'] / r['v4_ms']:.2f}x", f"{r['v32_ms'] / r['v4_ms']:.2f}x"] for r in result["figures"]]
    return ("## DeepSeek-V3, V3.2 and V4 at the same widths\n\nThe main forward of one decode step (1 row) and one "
            "verify pass (4 rows, k = 3) at the same tiny widths, random weights, batch 1 "
            "(`benchmarks/family_step.py`; the widths keep the cache per token per layer and the indexers alike). "
            "V3 attends to every cached token, V3.2 to the 2048 its indexer selects; V4 attends to a 128-position "
            "window plus, in its CSA layer, the 512 of one entry per 4 tokens that its indexer selects and, in its "
            "HCA layer, every entry of one per 128 tokens. Two layers each, so the V4 model has one CSA and one "
            "HCA layer; the released V4 models alternate them.\n\n"
            + table(["cached tokens", "rows", "V3 (ms)", "V3.2 (ms)", "V4 (ms)", "V3 / V4", "V3.2 / V4"], rows)
            + "\n\n" + source(result, "family_step") + "\n")


def v4_loop_section() -> str:
    result = load("v4_loop")
    if result is None:
        return ""
    rows = [[r["batch"], r["k"], f"{r['tokens_per_s_each_round']:.1f}", f"{r['tokens_per_s_loop']:.1f}",
             f"{r['speedup']:.2f}x", "yes" if r["same_tokens"] else "no"] for r in result["figures"]]
    first = result["figures"][0]
    return ("## DeepSeek-V4: rounds in compiled loops\n\n`speculative.decode` runs V4's rounds in compiled loops "
            f"of {first['loop_rounds']} rounds (`run_rounds`), against a host wait after every round "
            "(`segment_rounds=1`), side by side in one run: greedy new tokens per second of `speculative.generate` "
            f"({first['new_tokens']} new tokens after a 64-token prompt, its prefill included) on a tiny random V4 "
            "with an MTP block (`benchmarks/v4_loop.py`). The random MTP block's drafts are rarely right, so k = 2 "
            "costs more than it gains here; the table compares the two ways of running the same rounds.\n\n"
            + table(["batch", "k", "a host wait every round (tokens/s)", "loops (tokens/s)", "loops / each round",
                     "same tokens"], rows)
            + "\n\n" + source(result, "v4_loop") + "\n")


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _to_fit(verdict: str) -> str:
    """The setting a plan's verdict names ("fits with X=0.90"), or why none does; "" where it fits."""
    if "; fits with " in verdict:
        return verdict.split("; ")[1]
    if ": it needs " in verdict:
        return "needs " + verdict.split(": it needs ")[1]
    return ""


def _nothing_fits(plans: dict) -> str:
    """Why `--fit` found no cache for DeepSeek-V3 on one node of 8 H200s, from the plans of that mesh."""
    node = [f for f in plans.values() if f["config"] == "deepseek_v3_671b" and f["mesh"]["data"] == 8
            and f["devices"] == 8]
    limit = next(v["limit_bytes"] for d, v in node[0]["limits"].items() if d.startswith("H200"))
    params = node[0]["parameter_bytes_per_device"]
    return (f"The longest cache (and prompt as long) within an H200's default limit on one node of 8, DeepSeek-V3 "
            f"671B, `data=8` (`--fit`): none. In these CPU plans the parameters take {gb(params)} GB of each "
            f"device's {gb(limit)} GB, which leaves {gb(limit - params)} GB, less than the temporaries of any plan of "
            f"that mesh above (at least {gb(min(f['xla_temp_bytes'] for f in node))} GB).")


def plans_section() -> str:
    result = load("plans")
    if result is None:
        return ""
    rows, fit = [], []
    plans = {name: f for name, f in result["figures"].items() if not name.startswith("fit_")}
    limited = all("limits" in f for f in plans.values())  # counted against JAX's allocator limit
    for name, f in result["figures"].items():
        if name.startswith("fit_"):
            fit = f
            continue
        mesh = ",".join(f"{axis}={size}" for axis, size in f["mesh"].items() if size > 1)
        row = [f["config"], mesh, f["batch"], f["cache_len"], f["prompt_len"], f["loop"] if limited else f["k"],
               gb(f["parameter_bytes_per_device"]), gb(f["cache_bytes_per_device"]), gb(f["xla_temp_bytes"]),
               gb(f["total_bytes_per_device"])]
        if limited:
            fits = ", ".join(d.split(" (")[0] for d, limit in f["limits"].items() if limit["fits"]) or "none listed"
            settings = "; ".join(f"{d.split(' (')[0]}: {_to_fit(limit['verdict'])}"
                                 for d, limit in f["limits"].items() if _to_fit(limit["verdict"]))
            rows.append(row + [fits, settings or "-"])
        else:
            rows.append(row + [", ".join(d.split(" (")[0] for d, ok in f["fits"].items() if ok) or "none listed"])
    text = ("## Memory at scale (`jaxmtp plan`)\n\nPer-device bytes of the whole generation program (chunked "
            "prefill + speculative loop), FP8 weights kept and multiplied by the W8A8 kernels, from XLA's memory "
            "analysis of an AOT compile for emulated devices (`benchmarks/plans.py`). CPU figures over-count a GPU's "
            "(see [large_models.md](large_models.md)).\n\n")
    if limited:
        text += ("Each plan compiles the `speculative_k=\"auto\"` loop with sampling (what `jaxmtp generate` runs by "
                 "default) and k = 3, and shows the larger. \"fits\" counts against the memory JAX may hold at its "
                 "default settings: 75% of a GPU's memory (`XLA_CLIENT_MEM_FRACTION`), a TPU's whole memory, each "
                 "device's memory taken as its decimal nameplate figure; \"to fit\" gives the fraction that holds "
                 "the plan with 2% to spare.\n\n"
                 + table(["config", "mesh", "batch", "cache", "prompt", "largest loop", "params GB", "caches GB",
                          "temporaries GB", "total GB", "fits", "to fit"], rows))
    else:
        text += ("These figures were measured by an earlier `benchmarks/plans.py`: a greedy fixed-k loop only, and "
                 "\"fits\" compares with the device's whole memory, not the 75% that JAX's allocator holds by default "
                 "on a GPU, which `jaxmtp plan` now counts.\n\n"
                 + table(["config", "mesh", "batch", "cache", "prompt", "k", "params GB", "caches GB",
                          "temporaries GB", "total GB", "fits the device's memory"], rows))
    if "fit_h200_v3_one_node" in result["figures"] and not fit:
        text += "\n\n" + _nothing_fits(plans)
    if fit:
        fit_rows = [[f["batch"], f["cache_len"], gb(f["total_bytes_per_device"])] for f in fit]
        within = (f"within {fit[0]['limit']}" if "limit" in fit[0]
                  else "that fits an H200's whole memory (141 GB, not JAX's default limit)")
        text += (f"\n\nThe longest cache (and prompt as long) {within}, on one node of 8, DeepSeek-V3 671B, "
                 "`data=8`:\n\n" + table(["batch", "cache tokens", "total GB"], fit_rows))
    return text + "\n\n" + source(result, "plans") + "\n"


def plans_v4_section() -> str:
    results = [(name, load(name)) for name in ("plans_v4", "plans_v4_x128")]
    results = [(name, result) for name, result in results if result is not None]
    if not results:
        return ""
    loop = next((f["rows"][0]["loop"] for _, result in results for f in result["figures"].values() if f["rows"]),
                "the auto loop")
    return ("## DeepSeek-V4 memory at scale (`jaxmtp plan --fit`)\n\n"
            "The longest cache (with a prompt as long, prefilled in chunks) that fits per batch, from XLA's memory "
            "analysis of AOT compiles for emulated devices (`benchmarks/plans_v4.py`): the prefill chunk program and "
            f"the round of the most drafts that the loop may take ({loop}), whichever holds more; FP8 "
            "linears and FP4 experts kept as a released checkpoint loads; JAX's default limits. These are XLA:CPU's "
            "figures: the CPU widens bfloat16 products to float32 and expands the prefill's grouped expert matmuls "
            "(`ragged_dot`) into dense products over every local expert (the prefill's largest temporaries, growing "
            "with the chunk, the batch and the local experts), where a GPU's XLA runs them as grouped GEMMs, so a "
            "GPU should hold less; the meshes with more local experts per device prefill in smaller chunks for that "
            "reason. No V4 model has run on a GPU or a TPU, and no published V4 checkpoint has been loaded.\n\n"
            + "\n\n".join(_v4_fits(result["figures"]) + "\n\n" + source(result, name) for name, result in results)
            + "\n")


def _v4_fits(figures: dict) -> str:
    parts = []
    for name, f in figures.items():
        mesh = ",".join(f"{axis}={size}" for axis, size in f["mesh"].items() if size > 1)
        head = (f"**{f['config']}, {f['devices']} x {f['device']}, `{mesh}`**, prefilled in chunks of "
                f"{f['prefill_chunk']}, within {f['limit']}")
        if not f["rows"]:
            smallest = min(f["compiled"], key=lambda c: c["total_bytes_per_device"])
            parts.append(f"{head}: nothing fits. The parameters take {gb(f['parameter_bytes_per_device'])} GB of each "
                         f"device's {gb(f['limit_bytes'])} GB; the smallest plan compiled (batch {smallest['batch']}, "
                         f"cache {smallest['cache_len']}) held {gb(smallest['programs']['prefill_chunk'])} GB in its "
                         f"prefill chunk and {gb(smallest['programs']['run_round'])} GB in its round.")
            continue
        rows = [[r["batch"], r["cache_len"], gb(r["parameter_bytes_per_device"]), gb(r["cache_bytes_per_device"]),
                 gb(r["xla_temp_bytes"]), gb(r["total_bytes_per_device"]), r["largest_program"].replace("_", " ")]
                for r in f["rows"]]
        parts.append(head + ":\n\n" + table(["batch", "cache tokens", "params GB", "caches GB", "temporaries GB",
                                               "total GB", "largest program"], rows))
    return "\n\n".join(parts)


def plans_v4_depth_section() -> str:
    result = load("plans_v4_depth")
    if result is None:
        return ""
    rows = [[r["layers"], gb(r["parameter_bytes_per_device"]), gb(r["temp_bytes"]["run_round"]),
             gb(r["temp_bytes"]["prefill_chunk"])] for r in result["figures"]]
    return ("### DeepSeek-V4's temporaries by depth\n\n"
            "A round (k = 2, greedy, batch 8, 8K-token caches) and a prefill chunk of V4-Flash cut to its first layers, "
            "FP4 experts kept, on 8 emulated devices (`expert=8`; `benchmarks/plans_v4.py --depths`). Each segment's "
            "repeated layers run in a loop, so one unit's dequantized experts are live at a time and the "
            "temporaries do not grow with depth; at 5 layers the (HCA, CSA) pair occurs once, and a segment of one "
            "repeat is not a loop.\n\n"
            + table(["layers", "params GB", "round temporaries GB", "prefill chunk temporaries GB"], rows)
            + "\n\n" + source(result, "plans_v4_depth") + "\n")


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


def fraction(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def amount(n: int) -> str:
    """Bytes in GB, MB or kB, whichever keeps a figure of at least 1."""
    unit, scale = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6)) if n >= s), ("kB", 1e3))
    return f"{n / scale:.2f} {unit}"


def real_width_result(result: dict, name: str, paired: dict | None = None) -> str:
    """One run of benchmarks/real_width.py: its decode steps and rounds (beside the same rows of
    `paired`, a run with command buffers, where given) and its V3.2 sparse-against-dense steps."""
    f = result["figures"]
    moe = f["layers"] - f["dense_layers"]
    where = f["device_kind"] + (", XLA command buffers over the loop's control flow" if f["command_buffers"] else "")
    widths = "Tiny" if f["widths"] == "tiny" else "The configs'"
    text = (f"### {where}\n\n{widths} widths, {f['dense_layers']} dense and "
            f"{moe} MoE layers and the MTP layer, random FP8 weights (`matmul=\"{f['matmul']}\"`), greedy, "
            f"{f['calls']} rounds per timed loop, medians. Bandwidth: "
            + (f"fraction of {f['peak_bytes_per_s'] / 1e12:.2f} TB/s ({f['peak_source']})." if f["peak_bytes_per_s"]
               else f"no fraction: {f['peak_source']}.")
            + ("" if f["complete"] else " The run ended before all its rows were measured.") + "\n")
    v3 = f.get("v3")
    if v3:
        other = {(r["batch"], r["k"]): r for r in (paired or {}).get("figures", {}).get("v3", {}).get("rows", [])}
        header = ["batch", "k", "ms per round", "read", "of which KV cache", "of which routed experts",
                  "fraction of bandwidth"] + (["ms with command buffers"] if paired else [])
        rows = []
        for r in v3["rows"]:
            row = [r["batch"], f"{r['k']} (plain step)" if r["k"] == 0 else r["k"], f"{r['seconds'] * 1e3:.3f}",
                   amount(r["bytes"]), amount(r["kv_cache_bytes"]), amount(r["routed_expert_bytes"]),
                   fraction(r["fraction_of_peak"])]
            if paired:
                match = other.get((r["batch"], r["k"]))
                row.append("-" if match is None else f"{match['seconds'] * 1e3:.3f}")
            rows.append(row)
        speedups = "; ".join(f"batch {s['batch']}, acceptance {s['acceptance']:.2f}: {s['speedup']:.2f}x"
                             for s in v3["speedup_at_published_acceptance"])
        text += (f"\nDeepSeek-V3 (`{v3['config']}`), {f['context']} cached tokens ({v3['cache_slots']} cache "
                 "slots):\n\n"
                 + table(header, rows)
                 + (f"\n\nThe decode speedup of k = 1 over plain steps that these times imply at DeepSeek's published "
                    f"acceptance ({f['acceptance_source']}): {speedups}.\n" if speedups else "\n"))
    v32 = f.get("v32")
    if v32:
        rows = [[r["cached_tokens"], r["batch"], f"{r['sparse']['seconds'] * 1e3:.3f}",
                 f"{r['dense']['seconds'] * 1e3:.3f}", f"{r['dense_over_sparse']:.2f}x", amount(r["sparse"]["bytes"]),
                 amount(r["dense"]["bytes"]), fraction(r["sparse"]["fraction_of_peak"]),
                 fraction(r["dense"]["fraction_of_peak"])] for r in v32["rows"]]
        text += (f"\nDeepSeek-V3.2 (`{v32['config']}`), a plain decode step with sparse attention (the indexer selects "
                 f"{v32['index_topk']} keys) against the same weights attending over the whole cache:\n\n"
                 + table(["cached tokens", "batch", "sparse (ms)", "dense (ms)", "dense / sparse", "sparse reads",
                          "dense reads", "sparse fraction", "dense fraction"], rows) + "\n")
    return text + "\n" + source(result, name) + "\n"


def real_width_section() -> str:
    """Every benchmarks/results/*real_width*.json, a run with command buffers beside the run of the
    same name without them (NAME_real_width_cmdbuf beside NAME_real_width)."""
    names = sorted(n.removesuffix(".json") for n in os.listdir(RESULTS) if "real_width" in n and n.endswith(".json"))
    parts = []
    for name in names:
        if name.endswith("_cmdbuf") and name.removesuffix("_cmdbuf") in names:
            continue  # rendered beside its default run
        paired = load(name + "_cmdbuf")
        parts.append(real_width_result(load(name), name, paired)
                     + ("" if paired is None else "\n" + source(paired, name + "_cmdbuf") + "\n"))
    intro = ("## Decode speed at DeepSeek-V3 671B widths\n\nA plain decode step and a speculative round at k = 1..3 "
             "of the engine's decode loop at the configs' widths with a few layers of random FP8 weights, at batch 1, 8 "
             "and 32, and the bytes each reads: the weights read whole, the routed experts the tokens chose and the KV "
             "cache attention reads, with the fraction of the device's memory bandwidth that achieves; DeepSeek-V3.2's "
             "sparse attention against dense at 32K and 128K cached tokens; the same with XLA's command buffers "
             "extended to the loop's control flow (`benchmarks/real_width.py`, the `real_width` steps of "
             "`benchmarks/accelerator.sh`).\n\n")
    if not parts:
        return intro + ("It has not run on a GPU or TPU yet, so there is no figure to show: the test suite runs it at "
                        "tiny widths on a CPU only.\n")
    return intro + "\n".join(parts)


def _greedy_line(figures: dict) -> str:
    """How every configuration's greedy outputs compare with the reference's, and the prompts whose
    ids differ."""
    greedy = figures["greedy"]
    if greedy["reference"] is None:
        return "Sampled requests: each setting draws its own tokens, so no outputs are compared."
    counts = "; ".join(f"{config}: {n['same_tokens']}/{n['compared']} the same token ids"
                       + (f", {n['same_text']}/{n['compared']} the same text" if config == "hf" else "")
                       for config, n in greedy["matched"].items() if config != greedy["reference"])
    text = f"Greedy outputs against {greedy['reference']}'s, request by request: {counts or 'nothing to compare'}."
    differing = [f"{m['config']} at {m['load']}, prompt {m['prompt']}, from token {m['first_difference']} "
                 f"({'the same' if m['same_text'] else 'another'} text)" for m in greedy["mismatches"]]
    if differing:
        text += " Ids differ: " + "; ".join(differing) + "."
    if any(m["same_text"] and m["config"] == "hf" for m in greedy["mismatches"]):
        text += (" HF's ids are its streamed text encoded again, which merges tokens that the model generated "
                 "apart (two newline tokens where one token holds both): the same text, other ids.")
    return text


def _servers(configs: dict) -> str:
    """The servers' command lines, jaxmtp's that differ only in --speculative-k as one."""
    jaxmtp = {name: c for name, c in configs.items() if c["speculative_k"] is not None}
    shapes = {c["invocation"].replace(f"--speculative-k {c['speculative_k']}", "--speculative-k K")
              for c in jaxmtp.values()}
    if len(shapes) == 1:
        ks = ", ".join(f"{name}: {c['speculative_k']}" for name, c in jaxmtp.items())
        parts = [f"`{shapes.pop()}` with K = ({ks})"]
    else:
        parts = [f"{name}: `{c['invocation']}`" for name, c in jaxmtp.items()]
    return "; ".join(parts + [f"{name}: `{c['invocation']}`" for name, c in configs.items() if name not in jaxmtp])


def _cores(value) -> str:
    return "-" if value is None else f"{round(value, 1) + 0.0:.1f}"  # + 0.0: no "-0.0"


def serving_result(result: dict, name: str) -> str:
    """One run of benchmarks/serving.py: output tokens/s, TTFT and ITL per configuration and load,
    the servers' command lines, and how the greedy outputs compared."""
    f, device = result["figures"], result["provenance"]["device"]
    rows = [[r["config"], r["load"], f"{r['output_tokens_per_s']:.0f}", f"{r['ttft_p50_ms']:.0f}",
             f"{r['ttft_p99_ms']:.0f}", f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
             f"{r['tokens_per_chunk']:.1f}", _cores(r["other_cores"])] for r in f["rows"]]
    first = [r for r in f["rows"] if r["config"] == f["rows"][0]["config"]]
    requests = ", ".join(f"{r['requests'] // f['repeats']} at {r['load']}" for r in first)
    prompts = f"{sum(r['requests'] for r in first)} {f['prompts']}"
    hf = f["configs"].get("hf")
    peer = f" HF: transformers {hf['transformers']}, torch {hf['torch']}." if hf else ""
    where = "On this project's CPU" if device["platform"] == "cpu" else f"On {device['kind']}"
    loads = ", ".join(r["load"] for r in first)
    per_phase = sorted({r["requests"] // f["repeats"] for r in first})
    started = ("started together" if f.get("start_together")
               else "started one after another in the order of the table")
    return (f"### {where}: {loads}, {f['max_tokens']} new {'sampled' if f.get('temperature') else 'greedy'} tokens, "
            f"{'/'.join(map(str, per_phase))} requests per phase: "
            f"{', '.join(f['configs'])}\n\n{prompts_label(result, prompts)}; "
            f"{f['max_tokens']} {_tokens_asked(f)} per request; "
            f"requests per phase: {requests}; {f['repeats']} repeats of each load, the servers ({started}) taking turns. "
            f"Servers: {_servers(f['configs'])}.{peer} Output tokens/s: the median over the repeats; TTFT and ITL: "
            "over all their requests; tokens/chunk: tokens per streamed chunk; other cores: the most cores that "
            "other processes (the idle servers, other work on the machine) kept busy during a phase, to about 0.1 "
            "(the kernel counts a process's time and the machine's apart).\n\n"
            + table(["config", "load", "output tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)",
                     "ITL p99 (ms)", "tokens/chunk", "other cores"], rows)
            + "\n\n" + _auto_line(result) + _pairs_line(result) + _greedy_line(f) + "\n\n"
            + source(result, name) + "\n")


def _tokens_asked(figures: dict) -> str:
    """'greedy tokens', or how the requests sampled (results before sampling was an option are greedy)."""
    if not figures.get("temperature"):
        return "greedy tokens"
    return (f"tokens sampled at temperature {figures['temperature']:g}, top-p {figures['top_p']:g} "
            "(each request seeded by its prompt)")


def _by_repeat(rows: list[dict], name: str, reference: str, load: str) -> str:
    """`name`'s tokens/s over `reference`'s at `load`, as the median of their per-repeat ratios (the
    servers take turns, so repeat i of each ran at about the same time) with a bootstrap 90%
    interval (engine_ab's `paired`); '' where either is missing."""
    rates = {r["config"]: r["output_tokens_per_s_by_repeat"] for r in rows if r["load"] == load}
    if name not in rates or reference not in rates:
        return ""
    return f"{_ratio(paired(rates, name, reference, np.random.default_rng(0)))} of {reference}"


def _auto_line(result: dict) -> str:
    """Auto's tokens/s over the best fixed setting's at each load (by medians, and as the median of
    per-repeat ratios with its interval), and over plain's where plain was not the best, the rounds
    auto ran at each k and the segments each ran by batch bucket (where the results hold them); ''
    without auto or with no fixed setting beside it."""
    rows = result["figures"]["rows"]
    fixed = [r for r in rows if r["config"] == "plain" or r["config"][1:].isdigit()]
    parts = []
    for auto in (r for r in rows if r["config"] == "auto"):
        peers = [r for r in fixed if r["load"] == auto["load"]]
        if not peers:
            continue
        best = max(peers, key=lambda r: r["output_tokens_per_s"])
        load = auto["load"]
        plain = "" if best["config"] == "plain" else _by_repeat(rows, "auto", "plain", load)
        ratios = _by_repeat(rows, "auto", best["config"], load) + (f", {plain}" if plain else "")
        rounds = _phase_counts(result, "auto", load, "rounds_by_k")
        ran = "; rounds at k = " + ", ".join(f"{k}: {rounds[k]:.0f}" for k in sorted(rounds)) if rounds else ""
        for config in ("auto", best["config"]):
            segments = _phase_counts(result, config, load, "segments_by_bucket")
            if segments:
                ran += f"; {config}'s segments by bucket: " + ", ".join(f"{b}: {segments[b]:.0f}" for b in sorted(segments))
        parts.append(f"{load} {auto['output_tokens_per_s'] / best['output_tokens_per_s']:.2f} of "
                     f"{best['config']} by medians (per-repeat ratios, median and 90% interval: {ratios}){ran}")
    return "Auto against the fastest of plain and fixed k: " + "; ".join(parts) + ".\n\n" if parts else ""


def _pairs_line(result: dict) -> str:
    """At each load, the control's tokens/s over plain's (two identical servers: how far apart the
    harness measures the same thing) and jaxmtp's plain and auto over HF's, as per-repeat ratios
    (`_by_repeat`); '' where the run has neither a control nor HF."""
    rows = result["figures"]["rows"]
    parts = []
    for load in dict.fromkeys(r["load"] for r in rows):
        ratios = [f"{name} {text}" for name, reference in (("control", "plain"), ("plain", "hf"), ("auto", "hf"))
                  if (text := _by_repeat(rows, name, reference, load))]
        if ratios:
            parts.append(f"{load}: {'; '.join(ratios)}")
    return ("Per-repeat ratios (median, bootstrap 90% interval): " + "; ".join(parts) + ".\n\n") if parts else ""


def _phase_counts(result: dict, config: str, load: str, key: str) -> collections.Counter:
    """A server's counts under `key` (rounds_by_k, segments_by_bucket) summed over its phases at `load`."""
    counts = collections.Counter()
    for phase in result.get("raw", {}).get("phases", []):
        if phase["config"] == config and phase["load"] == load and phase.get(key):
            counts.update({int(label): n for label, n in phase[key].items()})
    return counts


def serving_section() -> str:
    """Every benchmarks/results/serving*.json."""
    return results_section("serving", "## Serving (`jaxmtp serve` beside `transformers serve`)\n\n"
            "Streaming clients against OpenAI-compatible servers, each a process of its own on one machine: "
            "`jaxmtp serve` with plain decoding, each fixed k and auto, and HF's `transformers serve "
            "--continuous-batching` on the same checkpoint (`benchmarks/serving.py`). Closed-loop loads keep c "
            "requests in flight; a rate is Poisson arrivals. Each phase's prompts are new to every server, so no "
            "prefix cache helps. Every request generates the same number of tokens: the end of text is ignored "
            "(jaxmtp: `ignore_eos`; HF: `generation_config` `{\"eos_token_id\": -1}`). jaxmtp takes the prompts "
            "as token ids and streams the completion's ids, several tokens per chunk (the steps of a decode "
            "segment); HF's `/v1/completions` takes and streams text, so it gets the prompts' text (each encodes "
            "back to the same ids) and its streamed text is encoded again. HF's KV cache holds as many positions "
            "as jaxmtp's (`--cb-num-blocks`; left to itself on a CPU it takes most of the free memory, and its "
            "attention masks grow with it). TTFT: from sending a request to its first token; ITL: per token (a "
            "chunk of n tokens g after the previous chunk counts n latencies of g / n).\n\n", serving_result)


def _ratio(p: dict) -> str:
    """A paired ratio (engine_ab's `paired`) as "median (low..high)"."""
    return f"{p['median']:.3f} ({p['interval_90'][0]:.3f}..{p['interval_90'][1]:.3f})"


def engine_ab_result(result: dict, name: str) -> str:
    """One run of benchmarks/engine_ab.py: each setting's median tokens/s, its paired ratio to the
    first setting with the bootstrap interval, its rounds by k, and (where recorded) its segments
    by batch bucket with the calibrated cost of a round at the engine's lowest k in each."""
    f = result["figures"]
    ref = f["reference"]
    order = [ref, *f["paired"]]
    label = {"0": "0 (plain)"}
    label[control_name(ref)] = f"{label.get(ref, ref)} again (control)"
    rows = [[label.get(ref, ref), f"{f['tokens_per_s'][ref]:.0f}", "1 (reference)", "", _rounds(f["rounds_by_k"][ref])]]
    rows += [[label.get(n, n), f"{f['tokens_per_s'][n]:.0f}", f"{p['median']:.3f}",
              f"{p['interval_90'][0]:.3f}..{p['interval_90'][1]:.3f}", _rounds(f["rounds_by_k"][n])]
             for n, p in f["paired"].items()]
    header = ["speculative_k", "median tokens/s", f"paired ratio to {ref} (median)", "90% interval", "rounds by k"]
    buckets = f.get("segments_by_bucket")  # recorded by later runs
    if buckets:
        header.append("segments by bucket (calibrated ms per round at the engine's lowest k)")
        for row, n in zip(rows, order):
            costs = f["calibrated_round_ms"][n]["by_bucket"]
            row.append(", ".join(f"{b}: {count:,} ({costs[b][0]:.1f})" for b, count in buckets[n].items()))
    low, high = f["prompt_lens"]
    prompts = prompts_label(result, f"prompts cut to seeded lengths of {low}..{high} tokens")
    created = f.get("created")  # recorded by later runs
    made = f" Engines created in the order {', '.join(label.get(n, n) for n in created)}." if created else ""
    first = f"; {label.get(created[0], created[0])} created first" if created else ""
    return (f"### Concurrency {f['concurrency']}: {', '.join(label.get(n, n) for n in order)}{first}\n\n"
            f"{f['slots']} slots, max_len {f['max_len']}; {f['phases']} phases of {f['requests_per_phase']} requests, "
            f"{f['max_tokens']} greedy tokens each, {f['concurrency']} at a time; {prompts}.{made}\n\n"
            + table(header, rows) + "\n\n" + _both_orders(result, name, label) + source(result, name) + "\n")


def _both_orders(result: dict, name: str, label: dict) -> str:
    """For a run NAME_reversed beside a run NAME of the same settings in the other creation order:
    every setting's paired ratios of both runs pooled (median, bootstrap 90% interval), else ""."""
    if not name.endswith("_reversed"):
        return ""
    other = load(name.removesuffix("_reversed"))
    f = result["figures"]
    same = ("concurrency", "slots", "max_len", "requests_per_phase", "max_tokens", "prompt_lens", "reference")
    if other is None or any(other["figures"].get(key) != f.get(key) for key in same) \
            or set(other["figures"]["paired"]) != set(f["paired"]):
        return ""
    rates = {n: other["raw"]["tokens_per_s"][n] + result["raw"]["tokens_per_s"][n] for n in result["raw"]["tokens_per_s"]}
    ref, rng = f["reference"], np.random.default_rng(0)
    pooled = [f"{label.get(n, n)} {_ratio(paired(rates, n, ref, rng))}" for n in f["paired"]]
    control = control_name(ref)
    against = ""
    if control in rates:
        ratios = [f"{label.get(n, n)} {_ratio(paired(rates, n, control, rng))}" for n in f["paired"] if n != control]
        against = f"; ratio to the control: {'; '.join(ratios)}"
    return (f"Both creation orders pooled (this run and `{name.removesuffix('_reversed')}`, {len(rates[ref])} paired "
            f"phases), ratio to {label.get(ref, ref)} (median, 90% interval): {'; '.join(pooled)}{against}.\n\n")


def _rounds(by_k: dict) -> str:
    return ", ".join(f"k = {k}: {n:,}" for k, n in sorted(by_k.items(), key=lambda kv: int(kv[0])))


def engine_ab_section() -> str:
    """Every benchmarks/results/engine_ab*.json."""
    return results_section("engine_ab", "## Serving engines side by side (`benchmarks/engine_ab.py`)\n\n"
            "The engine alone (no HTTP), the demo model: an engine per speculation setting in one process, all "
            "compiled and calibrated before the first phase. In each phase every engine serves the same requests "
            "in a closed loop, one engine after another, the order rotated by one each phase, so that a busy "
            "spell of the shared machine falls on every setting alike. Per phase, each setting's output tokens/s "
            "over the first's; the median of those ratios, and a bootstrap 90% interval of that median. The "
            "served runs above vary by 10% or more between phases of one setting; pairing the phases narrows "
            "the comparison to the few percent that decide whether auto keeps up with plain decoding where it "
            "decodes plainly. Runs with a control (a second engine of the reference setting, created last) "
            "show what the harness cannot resolve: two identical engines in one process, running the same "
            "compiled programs, can differ by a few percent, so a setting's ratio is read beside the control's, "
            "and pooled over both creation orders where both ran (`--created reversed`). Every engine calibrates "
            "its own round costs at start, and each segment runs in the "
            "smallest bucket that holds its rows unless a larger one is calibrated more than 10% cheaper, so that "
            "engines of one model can run their segments in different buckets (the last column, where recorded; "
            "its costs are calibration's early in the cache).\n\n", engine_ab_result,
            key=lambda name: (name.removesuffix("_reversed"), name.endswith("_reversed")))  # a run, then its reverse


def engine_latency_section() -> str:
    """benchmarks/results/engine_latency.json: the engine's inter-token latency with a long prompt
    arriving, and time to first token with prefix reuse."""
    result = load("engine_latency")
    if result is None:
        return ""
    f = result["figures"]
    lp, reuse = f["long_prompt"], f["prefix"]
    median = lp["median"]
    names = {"alone": "alone", "with_long_prompt": f"a {f['long_prompt_tokens']:,}-token prompt arrives (1 new token)",
             "with_long_request_decoding": f"a {f['long_prompt_tokens']:,}-token prompt arrives, then decodes 16 tokens "
                                           "beside them"}
    rows = [[names[case], f"{1e3 * m['gap_p99']:.0f}", f"{1e3 * m['per_token_p99']:.1f}",
             "1" if case == "alone" else f"{lp[case + '_gap_p99_ratio']:.2f} / {lp[case + '_per_token_p99_ratio']:.2f}"]
            for case, m in median.items()]
    first = reuse["median_first_token_s"]
    return ("## Serving engine latency (`benchmarks/engine_latency.py`)\n\n"
            f"The engine alone (no HTTP), greedy, the demo's weights with max_position_embeddings raised from 1,024 "
            f"to {f['context']:,} (both events need more positions; past 1,024 the text is beyond the model's "
            f"training, which changes what it writes, not what a step costs). The prompts: "
            f"{prompts_label(result, 'excerpts')}.\n\n"
            f"**A long prompt arriving.** {f['decoding_requests']} requests decode {f['new_tokens']} tokens each; "
            "the long prompt is submitted once all have their first token. Inter-token latency of the "
            f"{f['decoding_requests']}: the gap between two events with tokens, and that gap over its tokens (per "
            f"token); the median over {result['provenance']['repeats']} repeats of each p99, the cases taking turns.\n\n"
            + table(["case", "p99 gap (ms)", "p99 per token (ms)", "x alone (gap / per token)"], rows)
            + f"\n\n**Prefix reuse.** Requests whose prompts share a {f['prefix_tokens']:,}-token prefix (then "
            "64 tokens of their own), one at a time, after one request has filled the store: time to first token "
            f"{1e3 * first['with_reuse']:.0f} ms with reuse against {1e3 * first['without_reuse']:.0f} ms "
            f"without (an engine with no store), {reuse['speedup']:.1f}x sooner; the tokens are "
            f"{'identical' if reuse['identical_tokens'] else 'NOT identical'}.\n\n" + source(result, "engine_latency") + "\n")


def engine_profile_section() -> str:
    """benchmarks/results/engine_profile.json: where the engine's time goes under a closed-loop load,
    with prefill beside the decode segments and between them."""
    result = load("engine_profile")
    if result is None:
        return ""
    f = result["figures"]
    st = f["settings"]
    rows = [[mode, i, f"{r['tokens_per_second']:.0f}", f"{r['seconds']:.2f}", f"{r['prefill_seconds']:.2f}",
             f"{r['decode_seconds']:.2f}", r["segments"], r["rounds"], f"{r['live_rows_by_time']:.1f}",
             f"{r['bucket_by_time']:.1f}"] for mode, runs in f["runs"].items() for i, r in enumerate(runs)]
    ideal = st["requests"] * st["max_tokens"] / st["concurrency"]
    medians = f["median_tokens_per_second"]
    ratio = ""
    if {"beside", "between"} <= set(medians):
        ratio = f" Beside against between: {medians['beside'] / medians['between']:.2f}x."
    return ("## Where the serving engine's time goes (`benchmarks/engine_profile.py`)\n\n"
            f"The engine alone (no HTTP), the demo model, {st['concurrency']} slots and {st['concurrency']} clients "
            f"in a closed loop, {st['requests']} requests per repeat "
            f"({prompts_label(result, 'prompts of ' + st['prompt_lens'].replace(',', '..') + ' tokens')}), "
            f"{st['max_tokens']} greedy tokens each, k = {st['speculative_k']}, with prompts prefilled on a thread "
            "of their own beside the decode segments (`beside`, the default on a CPU) and between them "
            "(`between`): an engine each, their repeats alternating. Prefill: the seconds of prompt chunks and "
            "insertions; decode: of segments (each waited for; beside, the two overlap). Live rows and bucket: per "
            "segment, weighted by its time. At full occupancy the requests' tokens would take "
            f"{ideal:.0f} rounds.\n\n"
            + table(["prefill", "repeat", "tok/s", "s", "prefill s", "decode s", "segments", "rounds", "live rows",
                     "bucket"], rows)
            + "\n\nMedian tok/s: " + ", ".join(f"{mode} {v:.0f}" for mode, v in medians.items()) + "." + ratio
            + "\n\n" + source(result, "engine_profile") + "\n")


def prefix_attention_section() -> str:
    """benchmarks/results/prefix_attention.json: decode rounds and prefill chunks of the serving
    engine under each scheme of cache prefixes that the CPU layout's attention chooses from."""
    result = load("prefix_attention")
    if result is None:
        return ""
    f = result["figures"]
    st, medians = f["settings"], f["medians_seconds"]
    schemes = list(medians)
    first = medians[schemes[0]]
    rows = [[f"round, {key.split('@')[0]} rows from {key.split('@')[1]}"]
            + [f"{1e3 * medians[s]['rounds'][key]:.2f}" for s in schemes] for key in first["rounds"]]
    rows += [[f"chunk of {key.split('@')[0]} from {key.split('@')[1]}"]
             + [f"{1e3 * medians[s]['chunks'][key]:.2f}" for s in schemes] for key in first["chunks"]]
    prefixes = "; ".join(f"{s}: decode {', '.join(map(str, medians[s]['prefixes']['decode']))}, prefill "
                         f"{', '.join(map(str, medians[s]['prefixes']['prefill']))}" for s in schemes)
    return ("## Cache prefixes for attention on a CPU (`benchmarks/prefix_attention.py`)\n\n"
            f"The serving engine on the demo model (max_len {st['max_len']}), a process per scheme, the processes "
            "alternating: plain greedy decode rounds (as calibration times them, on seeded random ids) and prefill "
            "chunks of a held-out prompt, in ms, medians of every timed call. The prefixes each scheme chose from "
            f"(cache slots): {prefixes}.\n\n"
            + table(["pass"] + schemes, rows) + "\n\n" + source(result, "prefix_attention") + "\n")


def sampling_section() -> str:
    """benchmarks/results/sampling_cpu.json: the sampling filters by bisection against a sort, in the
    transform alone and in the serving engine's calibrated round costs."""
    result = load("sampling_cpu")
    if result is None:
        return ""
    f = result["figures"]
    st, alone, engine = f["settings"], f["transform_medians_seconds"], f["engine_medians"]
    rows = [[shape.replace("x", " x "), f"{1e3 * t['bisection']:.3f}", f"{1e3 * t['sort']:.3f}",
             f"{t['sort'] / t['bisection']:.1f}x", f"{f['transform_max_difference'][shape]:g}"]
            for shape, t in alone.items()]
    text = ("## Sampling filters (`benchmarks/sampling.py`)\n\n"
            "Top-k and top-p as `jaxmtp.sampling` finds their thresholds, by bisection, against a sort of the "
            "vocabulary per row (`sort`, the definition as `tests/test_sampling.py` writes it). The transform alone "
            "(temperature, top-k, top-p with per-row settings) at each logits shape, rows first and the vocabulary "
            "last, in ms per call (medians of "
            f"{st['calls']} alternating calls), and the largest difference of the two outputs:\n\n"
            + table(["logits", "bisection (ms)", "sort (ms)", "sort / bisection", "largest difference"], rows))
    if engine:
        first_table = next(iter(engine["bisection"]["costs"]["greedy"].values()))
        ks = "k = " + ", ".join(str(k) for k in range(len(first_table[0])))
        rows = []
        for mode in ("greedy", "mixed"):
            for bucket in engine["bisection"]["costs"][mode]:
                row = [mode if mode == "greedy" else "sampling", bucket]
                for scheme in ("bisection", "sort"):
                    row.append(" / ".join(f"{1e3 * c:.2f}" for c in engine[scheme]["costs"][mode][bucket][0]))
                rows.append(row)
        text += ("\n\nThe serving engine on the demo model (an auto engine of "
                 f"{st['slots']} slots, max_len {st['max_len']}, a process per scheme, the processes alternating): "
                 f"the round costs calibration measured, in ms per round at {ks} from its first position, medians "
                 "over the processes. Sampling rounds run with both filters on, as calibration sets them; greedy "
                 "rounds run no filter, so their two columns differ by the machine's noise alone.\n\n"
                 + table(["rounds", "batch", "bisection", "sort"], rows))
    return text + "\n\n" + source(result, "sampling_cpu") + "\n"


def page() -> str:
    parts = ["# Performance\n\nEvery figure here is rendered by `python benchmarks/render.py` from the results JSON in "
             "`benchmarks/results/`, which holds each run's provenance (commit, versions, device, flags, command, "
             "repeats, raw times). How to measure: [development.md](development.md).\n\n"
             "Each table's footnote names the commit its figures were measured at and whether that tree had "
             "uncommitted changes, and says where the engine (`jaxmtp/`, `pallas_kernels/`) has changed since: such "
             "figures were measured on an older engine than this page describes. The demo model's prompts are "
             "excerpts of its held-out standard-library modules shipped in `jaxmtp/benchmark_prompts.json`, the "
             "same text on every machine; results that record no prompts hash were measured before, on prompts cut "
             "from the measuring machine's own standard library, whose text differs between Python versions.\n",
             "## Speculative decoding on the demo model\n",
             bench_section("bench_cpu", "On this project's CPU"), bench_section("h200_bench", "On an H200"),
             auto_section(), decode_step_section(), serving_section(), engine_ab_section(),
             engine_profile_section(), engine_latency_section(), prefix_attention_section(), sampling_section(),
             sparse_section(),
             family_section(), v4_loop_section(),
             real_width_section(),
             plans_section(), device_plan_section(), plans_v4_section(), plans_v4_depth_section(), cold_start_section()]
    return "\n".join(p for p in parts if p).rstrip() + "\n"


def readme_table() -> str:
    """The README's one results table: the demo's best k against plain, auto, per device."""
    rows, notes = [], []
    for name, where in (("bench_cpu", "CPU"), ("h200_bench", "H200")):
        result = load(name)
        if result is None:
            continue
        # The commits stay in docs/performance.md's footnotes (measured_at): the README says only
        # whether the figures are the current engine's.
        engine = "an older engine" if engine_changed(result["provenance"]) else "the current engine"
        notes.append(f"{where}: measured with {engine}, {prompts_label(result, 'prompts')}.")
        by_k = {r["k"]: r for r in result["figures"]["rows"]}
        best = max((r for r in by_k.values() if r["k"] != "auto"), key=lambda r: r["speedup"])
        auto = by_k.get("auto")
        rows.append([where, f"{by_k[0]['tokens_per_s']:.0f}", f"k = {best['k']}: {best['speedup']:.2f}x",
                     "-" if auto is None else f"{auto['speedup']:.2f}x"])
    text = table(["demo model, batch 1", "plain tokens/s", "best fixed k", "auto"], rows)
    if notes:
        text += "\n\n" + " ".join(notes) + " Each run's commit: [docs/performance.md](docs/performance.md)."
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

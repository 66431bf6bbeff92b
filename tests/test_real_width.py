"""benchmarks/real_width.py (the accelerator step real_width) at tiny widths on the CPU: every row it
is asked for, bytes that match a count made here from the config's shapes, and its rendering by
benchmarks/render.py."""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

import jaxmtp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import render  # noqa: E402

# The script's run takes about 70 CPU-seconds, which the suite's time budget leaves to a run before
# accelerator.sh's (the only caller of the script at real widths): JAXMTP_LONG_TESTS=1.
pytestmark = pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"),
                                reason="runs benchmarks/real_width.py, about 70 CPU-seconds; set JAXMTP_LONG_TESTS=1")

BATCHES, KS, CACHED = (1, 2), (0, 1), 128
# One dense and one MoE layer and the MTP layer: every kind of layer, at the fewest compiles.
ARGS = ["--tiny", "--layers", "2", "--dense-layers", "1", "--batches", ",".join(map(str, BATCHES)),
        "--ks", ",".join(map(str, KS)), "--cached", str(CACHED), "--calls", "2", "--repeats", "2"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """The script run as accelerator.sh runs it, with --command-buffers (XLA:CPU parses the flag and
    ignores it), its compiler at its fastest (the times at these widths mean nothing)."""
    out = tmp_path_factory.mktemp("real_width") / "real_width.json"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0 "
                                                           "--xla_llvm_disable_expensive_passes=true")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "real_width.py"), *ARGS, "--command-buffers",
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_every_row_with_times_and_provenance(result):
    f, p = result["figures"], result["provenance"]
    assert f["complete"] and f["command_buffers"] and f["widths"] == "tiny"
    assert "--xla_gpu_enable_command_buffer=" in p["flags"]["XLA_FLAGS"]
    assert "WHILE" in p["flags"]["XLA_FLAGS"] and "CONDITIONAL" in p["flags"]["XLA_FLAGS"]
    assert p["repeats"] == 2 and "--tiny" in p["command"]
    rows = {(r["batch"], r["k"]): r for r in f["v3"]["rows"]}
    assert sorted(rows) == [(b, k) for b in BATCHES for k in KS]
    for (batch, k), r in rows.items():
        raw = result["raw"][f"v3/{batch}/{k}"]
        assert len(raw) == 2 and all(t > 0 for t in raw)
        assert r["seconds"] == statistics.median(raw)
        assert r["bytes"] > r["kv_cache_bytes"] > 0 and r["routed_expert_bytes"] > 0
        assert r["fraction_of_peak"] is None  # a CPU has no tabled peak
    assert rows[(1, 1)]["bytes"] > rows[(1, 0)]["bytes"]  # a round reads the MTP layer besides the main model
    assert f["peak_bytes_per_s"] is None and "CPU" in f["peak_source"]
    # k = 1 against plain steps at 85% and 90% acceptance, from the rows' own times
    for s in f["v3"]["speedup_at_published_acceptance"]:
        assert s["speedup"] == pytest.approx((1 + s["acceptance"]) * rows[(s["batch"], 0)]["seconds"]
                                             / rows[(s["batch"], 1)]["seconds"])
    assert {(s["batch"], s["acceptance"]) for s in f["v3"]["speedup_at_published_acceptance"]} == {
        (b, a) for b in BATCHES for a in (0.85, 0.90)}
    (v32,) = f["v32"]["rows"]
    assert v32["cached_tokens"] == CACHED and v32["batch"] == 1
    for name in ("sparse", "dense"):
        assert v32[name]["seconds"] > 0 and all(t > 0 for t in result["raw"][f"v32/{CACHED}/1/{name}"])
    assert v32["dense_over_sparse"] == pytest.approx(v32["dense"]["seconds"] / v32["sparse"]["seconds"])


def _fp8(out: int, inp: int) -> int:
    """An FP8 weight [out, in] with its float32 scales per 128 x 128 block."""
    return out * inp + 4 * math.ceil(out / 128) * math.ceil(inp / 128)


def test_plain_step_bytes_counted_from_the_shapes(result):
    """Batch 1, k = 0: the main model's weights but the embedding table and the routed experts,
    one embedding row, the num_experts_per_tok experts one token chooses, and every cache slot of
    both layers (bfloat16 cache of kv_lora_rank + qk_rope_head_dim per slot)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from real_width import TINY_WIDTHS

    c = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v3_671b.json").replace(
        num_hidden_layers=2, first_k_dense_replace=1, **TINY_WIDTHS)
    d, h, bf16 = c.hidden_size, c.num_attention_heads, 2
    attention = (_fp8(c.q_lora_rank, d) + _fp8(h * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank)
                 + _fp8(c.kv_lora_rank + c.qk_rope_head_dim, d)
                 + _fp8(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank) + _fp8(d, h * c.v_head_dim)
                 + bf16 * (c.q_lora_rank + c.kv_lora_rank + 2 * d))  # the attention's and the layer's norms
    mlp = lambda inner: 2 * _fp8(inner, d) + _fp8(d, inner)  # noqa: E731
    router = bf16 * c.n_routed_experts * d + 4 * c.n_routed_experts  # weight, float32 selection bias
    whole = (2 * attention + mlp(c.intermediate_size) + router + mlp(c.moe_intermediate_size * c.n_shared_experts)
             + bf16 * d + bf16 * c.vocab_size * d)  # final norm, head
    experts = c.num_experts_per_tok * mlp(c.moe_intermediate_size)
    f = result["figures"]
    cache = 2 * f["v3"]["cache_slots"] * (c.kv_lora_rank + c.qk_rope_head_dim) * bf16
    row = next(r for r in f["v3"]["rows"] if (r["batch"], r["k"]) == (1, 0))
    assert row["routed_experts_chosen"] == {"main_per_moe_layer": [c.num_experts_per_tok]}
    assert row["routed_expert_bytes"] == experts
    assert row["kv_cache_bytes"] == cache
    assert row["bytes"] == whole + bf16 * d + experts + cache


def test_rendered_by_render_py(result):
    f = result["figures"]
    text = render.real_width_result(result, "tiny_real_width", paired=result)
    for r in f["v3"]["rows"]:
        k = f"{r['k']} (plain step)" if r["k"] == 0 else str(r["k"])
        assert f"| {r['batch']} | {k} | {r['seconds'] * 1e3:.3f} | {render.amount(r['bytes'])} |" in text
    assert "ms with command buffers" in text  # the paired run's column
    v32 = f["v32"]["rows"][0]
    assert f"| {CACHED} | 1 | {v32['sparse']['seconds'] * 1e3:.3f} | {v32['dense']['seconds'] * 1e3:.3f} |" in text
    assert "acceptance 0.85" in text and "arXiv:2412.19437" in text
    assert "`benchmarks/results/tiny_real_width.json`" in text  # the footnote with the provenance


def test_section_renders_a_command_buffer_run_beside_its_default(result, tmp_path, monkeypatch):
    for name in ("tiny_real_width", "tiny_real_width_cmdbuf"):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    monkeypatch.setattr(render, "RESULTS", str(tmp_path))
    text = render.real_width_section()
    assert text.startswith("## Decode speed at DeepSeek-V3 671B widths")
    assert text.count("\n### ") == 1 and "ms with command buffers" in text  # one table, both runs
    assert "`benchmarks/results/tiny_real_width.json`" in text
    assert "`benchmarks/results/tiny_real_width_cmdbuf.json`" in text

"""Sharded models on 8 emulated CPU devices: same numbers and tokens as one device; real shards."""

import collections

import jax
import numpy as np
import pytest
from safetensors import safe_open

import generation_models as gm
import jaxmtp
from jaxmtp.sharding import make_mesh, place, shard_shapes
from jaxmtp.params import param_shardings

CONFIG, PROMPTS = gm.MESH_CONFIG, gm.MESH_PROMPTS
MESHES = [(1, 1, 8), (1, 8, 1), (2, 2, 2), (8, 1, 1)]  # each axis whole, and all three at once


@pytest.fixture(scope="module")
def single():
    return gm.model("partial", CONFIG)


def _on_mesh(model, sizes):
    mesh = make_mesh(*sizes)
    return jaxmtp.Model(model.config, place(model.params, param_shardings(model.config, model.params, mesh)), mesh)


@pytest.mark.parametrize("sizes", MESHES, ids=[f"data{d}_expert{e}_tensor{t}" for d, e, t in MESHES])
def test_sharded_model_matches_single_device(single, sizes):
    sharded = _on_mesh(single, sizes)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 12))
    expected, _ = single.forward(tokens)
    logits, _ = sharded.forward(tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=0, atol=1e-5)
    for k in (0, 2):
        want = jaxmtp.generate(single, PROMPTS, max_new_tokens=10, speculative_k=k).tokens
        assert jaxmtp.generate(sharded, PROMPTS, max_new_tokens=10, speculative_k=k).tokens == want, k
    assert sharded.decoding().layout.absorbed_queries  # W_uk folded in, columns split by head over tensor


def test_prefix_attention_on_a_mesh(single):
    """Rows split over `data` that run past the first cache prefix (256 of 512 slots) on a
    (2, 2, 2) mesh, speculating: the tokens of one device."""
    sharded = _on_mesh(single, (2, 2, 2))
    assert sharded.decoding().layout.prefix_attention
    prompts = [list(range(1, 241)), list(range(2, 250))]
    want = jaxmtp.generate(single, prompts, max_new_tokens=20, speculative_k=2).tokens
    assert jaxmtp.generate(sharded, prompts, max_new_tokens=20, speculative_k=2).tokens == want


def test_parameters_are_sharded_by_the_rules():
    mesh = make_mesh(data=1, expert=2, tensor=4)
    model = jaxmtp.init(CONFIG, seed=0, mesh=mesh)
    p, c = model.params, CONFIG
    L, E, I, D = c.num_moe_layers, c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
    moe = p["moe_layers"]["layers"]
    assert shard_shapes(moe["mlp"]["experts"]["gate_proj"]) == {(L, E // 2, I // 4, D)}  # experts / expert axis
    assert shard_shapes(moe["mlp"]["experts"]["down_proj"]) == {(L, E // 2, D, I // 4)}
    heads_out = c.num_attention_heads * c.qk_head_dim
    assert shard_shapes(moe["self_attn"]["q_b_proj"]["weight"]) == {(L, heads_out // 4, c.q_lora_rank)}  # heads
    assert shard_shapes(moe["self_attn"]["o_proj"]["weight"]) == {(L, D, c.num_attention_heads * c.v_head_dim // 4)}
    assert shard_shapes(p["embed_tokens"]["weight"]) == {(c.vocab_size // 4, D)}  # vocab over tensor
    assert shard_shapes(p["lm_head"]["weight"]) == {(c.vocab_size // 4, D)}
    assert shard_shapes(moe["mlp"]["gate"]["weight"]) == {(L, E, D)}  # the router stays whole
    assert shard_shapes(moe["mlp"]["shared_experts"]["up_proj"]["weight"]) == {(L, I // 4, D)}
    dense = p["dense_layers"]["layers"]["mlp"]["gate_proj"]["weight"]
    assert shard_shapes(dense) == {(c.num_dense_layers, c.intermediate_size // 4, D)}
    assert len(dense.sharding.device_set) == 8
    # init with a mesh draws the same numbers as without one
    plain = jaxmtp.init(CONFIG, seed=0)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_data_axis_splits_the_experts_too():
    """Data-parallel attention beside expert-parallel MoE: on (data=4, expert=2) the routed experts
    are split over all 8 devices, attention weights stay whole (each device attends for its rows)."""
    model = jaxmtp.init(CONFIG, seed=0, mesh=make_mesh(data=4, expert=2))
    moe, c = model.params["moe_layers"]["layers"], CONFIG
    L, E, I, D = c.num_moe_layers, c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
    assert shard_shapes(moe["mlp"]["experts"]["gate_proj"]) == {(L, E // 8, I, D)}
    assert shard_shapes(moe["self_attn"]["q_b_proj"]["weight"]) == {moe["self_attn"]["q_b_proj"]["weight"].shape}


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_load_places_shards(single, tmp_path, fmt):
    jaxmtp.save(single, tmp_path / fmt, format=fmt)
    mesh = make_mesh(data=2, expert=2, tensor=2)
    loaded = jaxmtp.load(tmp_path / fmt, mesh=mesh, quiet=True)
    assert loaded.mesh is mesh
    experts = loaded.params["moe_layers"]["layers"]["mlp"]["experts"]["up_proj"]
    L, E, I, D = experts.shape
    assert shard_shapes(experts) == {(L, E // 4, I // 2, D)}  # experts over data x expert, intermediate over tensor
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_kept_experts_run_expert_parallel(tmp_path):
    """FP8 values and block scales are cut together over the expert axis; logits equal one device."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    import hf_reference as ref

    torch.manual_seed(0)
    main = DeepseekV3ForCausalLM(DeepseekV3Config(**ref.FP8_CONFIG)).eval()
    ref.randomize(main, 2)
    ref.save_fp8(main, None, str(tmp_path))
    single = jaxmtp.load(tmp_path, dtype="float32", quantized="keep", quiet=True)
    sharded = jaxmtp.load(tmp_path, dtype="float32", quantized="keep", quiet=True, mesh=make_mesh(data=4, expert=2))
    experts = sharded.params["moe_layers"]["layers"]["mlp"]["experts"]["gate_proj"]
    assert {s[1] for s in shard_shapes(experts.value)} == {2} and {s[1] for s in shard_shapes(experts.scale)} == {2}
    tokens = np.random.default_rng(1).integers(0, 96, (4, 16))
    np.testing.assert_allclose(np.asarray(sharded.forward(tokens)[0]), np.asarray(single.forward(tokens)[0]),
                               rtol=0, atol=1e-5)


def test_sharded_load_reads_only_each_devices_block(single, tmp_path, monkeypatch):
    """On a mesh the loader reads each device's block on its own: reads of a split parameter cover
    only that block, and over all reads each element of every layer tensor is read exactly once
    (devices holding the same block share one read)."""
    from jaxmtp.checkpoint import sharded

    jaxmtp.save(single, tmp_path)
    elements, shapes = collections.Counter(), collections.defaultdict(set)
    original = sharded.TensorFiles.read

    def spy(self, name, region=(), bar=None):
        value = original(self, name, region, bar)
        elements[name] += value.size
        shapes[name].add(value.shape)
        return value

    monkeypatch.setattr(sharded.TensorFiles, "read", spy)
    loaded = jaxmtp.load(tmp_path, mesh=make_mesh(data=2, expert=2, tensor=2), quiet=True)
    c = CONFIG
    sizes = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            sizes.update({name: int(np.prod(f.get_slice(name).get_shape())) for name in f.keys()})
    layer_tensors = [n for n in sizes if n.startswith("model.layers.") and "embed_tokens" not in n and "shared_head.head" not in n]
    assert {n: elements[n] for n in layer_tensors} == {n: sizes[n] for n in layer_tensors}
    gate = f"model.layers.{c.first_k_dense_replace}.mlp.experts.0.gate_proj.weight"
    assert shapes[gate] == {(c.moe_intermediate_size // 2, c.hidden_size)}  # intermediate over tensor
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert shapes[q_b] == {(c.num_attention_heads * c.qk_head_dim // 2, c.q_lora_rank)}  # heads over tensor
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_dequantized_on_a_mesh_cuts_through_scale_blocks(tmp_path):
    """Tensor-parallel blocks of 64 rows start inside 128x128 scale blocks: each device's block is
    dequantized with the scales covering it, equal to the single-device load bit for bit."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    import hf_reference as ref

    torch.manual_seed(0)
    main = DeepseekV3ForCausalLM(DeepseekV3Config(**ref.FP8_TP_CONFIG)).eval()
    ref.randomize(main, 3)
    ref.save_fp8(main, None, str(tmp_path))
    single = jaxmtp.load(tmp_path, dtype="float32", quiet=True)
    sharded = jaxmtp.load(tmp_path, dtype="float32", quiet=True, mesh=make_mesh(data=2, tensor=4))
    experts = sharded.params["moe_layers"]["layers"]["mlp"]["experts"]["gate_proj"]
    assert {s[2] for s in shard_shapes(experts)} == {ref.FP8_TP_CONFIG["moe_intermediate_size"] // 4}
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plan_compiles_speculative_generation_for_an_emulated_mesh():
    from jaxmtp.plan import plan

    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json")
    figures = plan(config, data=2, expert=2, tensor=2, batch=4, max_len=128, prompt_len=16, k=2)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    assert figures["cache_bytes_per_device"] == layers * 2 * 128 * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    counts = jaxmtp.params.parameter_counts(config)
    total = 2 * (counts["main"] + counts["mtp_unique"])  # bf16
    assert total / 8 <= figures["parameter_bytes_per_device"] <= total  # at least an even share of 8 devices
    largest = [t["bytes"] for t in figures["largest_temporaries"]]
    assert largest == sorted(largest, reverse=True) and 0 < largest[0] <= figures["xla_temp_bytes"]


def test_plan_fit_finds_contexts_that_fit_and_no_much_longer_one():
    from jaxmtp.plan import fit, plan, total_bytes

    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json").replace(max_position_embeddings=65536)
    capacity = 60e6
    # Few devices, one batch and plain decoding (k = 0): compiles are what this test costs.
    results = fit(config, data=2, expert=1, tensor=1, capacity=capacity, k=0, rows=1)
    assert [r["batch"] for r in results] == [2]
    assert all(total_bytes(r) <= capacity and r["prompt_len"] == r["cache_len"] for r in results)
    longer = plan(config, 2, 1, 1, batch=2, max_len=results[0]["cache_len"] * 5 // 4,
                  prompt_len=results[0]["cache_len"] * 5 // 4, k=0)
    assert total_bytes(longer) > capacity

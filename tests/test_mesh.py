"""Sharded models on 8 emulated CPU devices: same numbers and tokens as one device; real shards."""

import collections
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import generation_models as gm
from long_tests import only_long
import jaxmtp
from jaxmtp.decoding import start
from jaxmtp.errors import InputError
from jaxmtp.generation import prepare
from jaxmtp.model import apply_forward
from jaxmtp.moe import expert_parallel_mesh
from jaxmtp.params import abstract_params, param_shardings
from jaxmtp.quant import quantize
from jaxmtp.sharding import ShardingWarning, make_mesh, place, shard_shapes

CONFIG, PROMPTS = gm.MESH_CONFIG, gm.MESH_PROMPTS
MESHES = [(1, 1, 8), (1, 8, 1), (2, 2, 2), (8, 1, 1)]  # each axis whole, and all three at once
# Run with JAXMTP_LONG_TESTS=1 (tests/long_tests.py): (2, 2, 2) splits the heads and the rows as well.
LONG_MESHES = {(1, 1, 8): "data=2, expert=2, tensor=2 splits the heads too",
               (8, 1, 1): "data=2, expert=2, tensor=2 splits the rows too"}


@pytest.fixture(scope="module")
def single():
    return gm.model("partial", CONFIG)


def _on_mesh(model, sizes):
    mesh = make_mesh(*sizes)
    return jaxmtp.Model(model.config, place(model.params, param_shardings(model.config, model.params, mesh)), mesh)


@pytest.mark.parametrize("sizes", [pytest.param(sizes, marks=only_long(LONG_MESHES[sizes])) if sizes in LONG_MESHES
                                   else sizes for sizes in MESHES],
                         ids=[f"data{d}_expert{e}_tensor{t}" for d, e, t in MESHES])
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


def test_unsplit_parameters_are_named_and_idle_axes_refused():
    """Where a mesh axis does not divide a dimension its rule splits, the parameter stays whole over
    it and one ShardingWarning names the dimension, the axis and the parameters; the test meshes
    divide everything and warn nothing; an axis that splits no parameter at all is refused."""
    for sizes in MESHES:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShardingWarning)
            param_shardings(CONFIG, abstract_params(CONFIG), make_mesh(*sizes))
    odd_vocab = CONFIG.replace(vocab_size=510)
    with pytest.warns(ShardingWarning, match=r"vocab 510 is not divisible by tensor=4: embed_tokens/weight, "
                                             r"lm_head/weight stay whole"):
        shardings = param_shardings(odd_vocab, abstract_params(odd_vocab), make_mesh(expert=2, tensor=4))
    assert shardings["embed_tokens"]["weight"].shard_shape((510, CONFIG.hidden_size)) == (510, CONFIG.hidden_size)
    q_b = (CONFIG.num_moe_layers, CONFIG.num_attention_heads * CONFIG.qk_head_dim, CONFIG.q_lora_rank)
    assert shardings["moe_layers"]["layers"]["self_attn"]["q_b_proj"]["weight"].shard_shape(q_b)[1] == q_b[1] // 4
    four_experts = CONFIG.replace(n_routed_experts=4, n_group=2, topk_group=1)  # over expert alone, whole over data
    with pytest.warns(ShardingWarning, match=r"expert 4 is not divisible by data x expert = 4 x 2: "
                                             r"split over expert=2 alone: moe_layers/layers/mlp/experts/"):
        shardings = param_shardings(four_experts, abstract_params(four_experts), make_mesh(data=4, expert=2))
    gate = (four_experts.num_moe_layers, 4, CONFIG.moe_intermediate_size, CONFIG.hidden_size)
    assert shardings["moe_layers"]["layers"]["mlp"]["experts"]["gate_proj"].shard_shape(gate)[1] == 2
    with pytest.raises(InputError, match="mesh axis expert=8 splits no parameter of this model "
                                         r"\(expert 4 is not divisible by expert=8\)"):
        param_shardings(four_experts, abstract_params(four_experts), make_mesh(expert=8))


def test_experts_that_cannot_run_parallel_say_why():
    """expert_parallel_mesh: the context mesh where the experts run expert/tensor-parallel; where
    they cannot, None and a ShardingWarning naming the axis; None without a mesh."""
    config = CONFIG.replace(moe_intermediate_size=36)
    gate = jnp.zeros((config.n_routed_experts, 36, config.hidden_size))
    assert expert_parallel_mesh(config, gate) is None  # one device
    with jax.set_mesh(make_mesh(data=2, expert=2, tensor=2)), warnings.catch_warnings():
        warnings.simplefilter("error", ShardingWarning)
        assert expert_parallel_mesh(config, gate) is not None
    with jax.set_mesh(make_mesh(tensor=8)), pytest.warns(
            ShardingWarning, match="moe_intermediate_size 36 is not divisible by tensor=8"):
        assert expert_parallel_mesh(config, gate) is None
    fp8 = config.replace(moe_intermediate_size=256)
    blocks = quantize(np.ones((fp8.n_routed_experts, 256, 128), np.float32))
    with jax.set_mesh(make_mesh(data=2, tensor=4)), pytest.warns(
            ShardingWarning, match="256 / tensor=4 = 64 rows per device would cut the FP8 weights' 128-row scale"):
        assert expert_parallel_mesh(fp8, blocks) is None
    four = config.replace(n_routed_experts=4, n_group=2, topk_group=1, moe_intermediate_size=32)
    with jax.set_mesh(make_mesh(data=8)), pytest.warns(
            ShardingWarning, match="n_routed_experts 4 is not divisible by data=8, and there is no tensor axis"):
        assert expert_parallel_mesh(four, gate[:4, :32]) is None


def test_sharded_parameters_outside_their_mesh_are_refused(single):
    """A model's jitted functions called on parameters placed on a mesh but with no mesh set would
    run another program (MoE without expert parallelism): they refuse, naming the function; the
    Model methods and generate set the mesh themselves."""
    sharded = _on_mesh(single, (2, 2, 2))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 12)), jnp.int32)
    with pytest.raises(InputError, match=r"apply_forward: arrays placed on a mesh \(data=2 x expert=2 x "
                                         r"tensor=2\) but no mesh is set: run it inside `with model.mesh_context"):
        apply_forward(sharded.config, sharded.dtype, sharded.layout, sharded.params, tokens)
    experts = sharded.params["moe_layers"]["layers"]["mlp"]["experts"]["gate_proj"]
    with pytest.raises(InputError, match="MoE experts: arrays placed on a mesh"):
        expert_parallel_mesh(CONFIG, experts)
    prepared = prepare(sharded, PROMPTS, max_new_tokens=4)
    with pytest.raises(InputError, match="decoding.start: arrays placed on a mesh"):
        start(prepared.static, prepared.params, prepared.inputs)
    with sharded.mesh_context():
        logits, _ = apply_forward(sharded.config, sharded.dtype, sharded.layout, sharded.params, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(single.forward(tokens)[0]), rtol=0, atol=1e-5)


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


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="compiles two loops for 8 devices, about 45 "
                    "CPU-seconds; set JAXMTP_LONG_TESTS=1 to run it")
def test_plan_compiles_the_auto_loop_and_a_fixed_k_for_an_emulated_mesh_and_counts_the_largest():
    import re

    from jaxmtp.generation import AUTO_MAX_K
    from jaxmtp.plan import DEVICES, AllocatorSettings, default_loops, memory_limit, plans, report, total_bytes

    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json")
    results = plans(config, data=2, expert=2, tensor=2, batch=4, max_len=128, prompt_len=16,
                    loops=default_loops(config, 2))  # what `jaxmtp plan` compiles by default
    assert [(r["k"], r["auto"]) for r in results] == [(AUTO_MAX_K, True), (2, False)]
    assert all("sampling with top-k and top-p" in r["loop"] for r in results)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    counts = jaxmtp.params.parameter_counts(config)
    total = 2 * (counts["main"] + counts["mtp_unique"])  # bf16
    for figures in results:
        assert figures["cache_bytes_per_device"] == layers * 2 * 128 * (config.kv_lora_rank
                                                                        + config.qk_rope_head_dim) * 2
        assert total / 8 <= figures["parameter_bytes_per_device"] <= total  # at least an even share of 8 devices
        largest = [t["bytes"] for t in figures["largest_temporaries"]]
        assert largest == sorted(largest, reverse=True) and 0 < largest[0] <= figures["xla_temp_bytes"]
    text = report(results, [memory_limit(DEVICES["h200"], AllocatorSettings())])
    biggest = max(results, key=lambda r: r["xla_argument_bytes"] + r["xla_temp_bytes"] + r["xla_output_bytes"])
    for r in results:  # a table row per loop (the tiny model's totals print as 0.00 GB)
        assert re.search("^" + re.escape(r["loop"]) + rf"\s+{total_bytes(r) / 1e9:.2f}\s", text, re.M), r["loop"]
    assert f"the largest, {biggest['loop']}:" in text
    assert "H200 (141 GB): allocator limit 105.75 GB = 0.75 x 141 GB (XLA_CLIENT_MEM_FRACTION unset: JAX's " \
           "default): fits (0% of the limit)" in text


def _memory_mappings() -> int | None:
    """This process's memory mappings (Linux), else None."""
    if not os.path.exists("/proc/self/maps"):
        return None
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="the search compiles a dozen plans, about 100 "
                    "CPU-seconds; set JAXMTP_LONG_TESTS=1 to run it")
def test_plan_fit_finds_contexts_that_fit_the_allocator_limit_and_no_much_longer_one():
    from jaxmtp.plan import AllocatorSettings, Device, Loop, fit, fit_report, memory_limit, plan, total_bytes

    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json").replace(max_position_embeddings=65536)
    # A GPU of 80 MB at JAX's default fraction: 60 MB.
    limit = memory_limit(Device("GPU", 80e6, gpu=True), AllocatorSettings())
    capacity = 0.75 * 80e6
    assert limit.bytes == pytest.approx(capacity)
    # Few devices, one batch and one greedy plain loop (k = 0): compiles are what this test costs.
    mappings = _memory_mappings()
    results = fit(config, data=2, expert=1, tensor=1, capacity=limit.bytes, k=0, rows=1, loops=[Loop(0)])
    assert [r["batch"] for r in results] == [2]
    # Each compile's program is released with it: the kernel's limit on a process's memory mappings
    # (65530 by default) stops a long --fit otherwise.
    assert mappings is None or _memory_mappings() - mappings < 200
    assert all(total_bytes(r) <= capacity and r["prompt_len"] == r["cache_len"] for r in results)
    assert [loop["total_bytes"] for loop in results[0]["loops"]] == [total_bytes(results[0])]
    text = fit_report(results, limit)
    assert text.startswith("GPU (0.08 GB): allocator limit 0.06 GB = 0.75 x 0.08 GB")
    assert f"{results[0]['cache_len']:12d}" in text and "XLA_CLIENT_MEM_FRACTION=0.95 would let JAX hold" in text
    longer = plan(config, 2, 1, 1, batch=2, max_len=results[0]["cache_len"] * 5 // 4,
                  prompt_len=results[0]["cache_len"] * 5 // 4, k=0)
    assert total_bytes(longer) > capacity

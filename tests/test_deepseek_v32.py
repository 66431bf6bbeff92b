"""DeepSeek-V3.2 (lightning indexer + top-k sparse attention) against HF transformers'
DeepseekV32ForCausalLM and the generic MtpLayer (PyTorch, float32), with prompts longer than
index_topk so that the selection decides what every pass attends to; its FP8 indexer against a
numpy reference written from DeepSeek's own inference code."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import deepseek_reference
import generation_models as gm
import hf_reference as ref
import jaxmtp
from long_tests import skip_unless_long
from jaxmtp import indexer
from jaxmtp.errors import ConfigError
from jaxmtp.mla import MLA
from jaxmtp.params import parameter_counts
from jaxmtp.quant import quantize

BATCH, LENGTH, NEW = 2, 24, 8
# Prompt lengths of a ragged batch, each past every config's index_topk (3, 6 and 11).
PROMPT_LENGTHS = (12, 19, 30)
# The generation tests' tiny model with DeepSeek Sparse Attention: each query reads at most 4 keys.
V32_TINY = gm.TINY.replace(model_type="deepseek_v32", index_n_heads=16, index_head_dim=16, index_topk=4)


@pytest.fixture(scope="module", params=sorted(ref.V32_CONFIGS))
def pair(request, tmp_path_factory):
    """(HF main, HF MTP, jaxmtp model loaded from the saved checkpoint, token ids [B, T+1], name)."""
    main, mtp = ref.build(request.param, seed=3)
    directory = ref.save(main, mtp, str(tmp_path_factory.mktemp(request.param)))
    ids = torch.randint(0, main.config.vocab_size, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(7))
    return main, mtp, jaxmtp.load(directory, quiet=True), ids, request.param


def test_logits_hidden_and_mtp_logits_match_transformers(pair):
    """Checkpoint and decode layouts; the MTP layer has its own indexer."""
    main, mtp, model, ids, _ = pair
    assert model.config.model_type == "deepseek_v32" and LENGTH > model.config.index_topk
    with torch.no_grad():
        expected_logits = main(ids[:, :LENGTH]).logits.numpy()
        hidden = main.model(ids[:, :LENGTH]).last_hidden_state
        expected_mtp = ref.mtp_logits(mtp, hidden, ids[:, 1:]).numpy()
    for layout_model in (model, model.decoding()):
        logits, got_hidden = layout_model.forward(ids[:, :LENGTH].numpy())
        np.testing.assert_allclose(np.asarray(logits), expected_logits, rtol=0, atol=1e-4)
        np.testing.assert_allclose(np.asarray(got_hidden), hidden.numpy(), rtol=0, atol=1e-4)
        mtp_logits = layout_model.mtp_forward(hidden.numpy(), ids[:, 1:].numpy())
        np.testing.assert_allclose(np.asarray(mtp_logits), expected_mtp, rtol=0, atol=1e-4)


# The speculative settings each config also runs (the property test below covers k = 1..4 on more
# prompts; each setting compiles its own loop).
SPECULATIVE = {"v32_yarn_groups": (1, 4), "v32_default_rope": (2,), "v32_attention_factor": (3,)}


def test_greedy_generate_matches_transformers_generate(pair):
    """A ragged batch, each prompt past index_topk: the prefill selects among the prompt, decode
    steps and verify passes (gathering the selected keys) among the cache. Plain and speculative
    decoding give HF's greedy tokens."""
    main, _, model, _, name = pair
    if name != "v32_default_rope":
        skip_unless_long("v32_default_rope's generation covers the loop, the other configs' logits HF parity")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, main.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = main.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    for k in (0, *SPECULATIVE[name]):
        got = jaxmtp.generate(model, prompts, max_new_tokens=NEW, speculative_k=k, eos_token_id=None)
        assert got.tokens == expected, k


@settings(max_examples=4, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["partial", "random"]), k=st.integers(1, 4),
       prompts=st.lists(st.lists(st.integers(0, V32_TINY.vocab_size - 1), min_size=1, max_size=20),
                        min_size=3, max_size=4))
def test_speculative_greedy_is_plain_greedy(kind, k, prompts):
    """Each of the k + 1 rows of a verify pass selects its own keys; drafts from an MTP layer with
    its own indexer: the tokens of plain greedy decoding."""
    model = gm.model(kind, V32_TINY)
    plain = jaxmtp.generate(model, prompts, max_new_tokens=12, eos_token_id=None)
    spec = jaxmtp.generate(model, prompts, max_new_tokens=12, speculative_k=k, eos_token_id=None)
    assert spec.tokens == plain.tokens


def test_top_keys_are_the_highest_visible_scores_lower_index_first():
    scores = jnp.asarray([[[0.5, -jnp.inf, 2.0, 0.5, 1.0, -jnp.inf]]])
    config = V32_TINY.replace(index_topk=3)
    indices, chosen = indexer.top_keys(config, scores)
    assert indices.tolist() == [[[2, 4, 0]]] and chosen.tolist() == [[[True, True, True]]]
    indices, chosen = indexer.top_keys(config.replace(index_topk=5), scores)
    assert sorted(np.asarray(indices)[chosen].tolist()) == [0, 2, 3, 4]  # the 5th is not visible
    mask = indexer.selected_mask(indices, chosen, 6)
    assert mask.tolist() == [[[True, False, True, True, True, False]]]


def test_long_cache_attends_to_the_selected_keys_blockwise(monkeypatch):
    """Prefill chunks over a cache of blocks (the selection masks the blockwise attention) and index
    scores a key block at a time: the tokens of one pass and whole-cache attention."""
    from jaxmtp import mla

    model = gm.model("partial", V32_TINY)
    prompts = [np.random.default_rng(2).integers(0, V32_TINY.vocab_size, n).tolist() for n in (70, 33, 5)]
    want = jaxmtp.generate(model, prompts, max_new_tokens=8, speculative_k=2, eos_token_id=None).tokens
    monkeypatch.setattr(mla, "KEY_BLOCK", 32)
    monkeypatch.setattr(indexer, "KEY_BLOCK", 32)
    monkeypatch.setattr(indexer, "MAX_HEAD_SCORES", 1024)
    got = jaxmtp.generate(model, prompts, max_new_tokens=8, speculative_k=2, prefill_chunk=16, eos_token_id=None)
    assert got.tokens == want


def _fp8_indexer_params(config, rng):
    """Random parameters of one MLA with its indexer; wq_b and wk block-quantized with ue8m0
    activation scales, as DeepSeek-V3.2 publishes them."""
    x = jnp.zeros((1, 1, config.hidden_size))
    shapes = nn.meta.unbox(MLA(config).init(jax.random.key(0), x, jnp.zeros((1, 1), jnp.int32)))["params"]
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) / np.sqrt(p.shape[-1]), jnp.float32), shapes)
    for name in ("wq_b", "wk"):
        params["indexer"][name]["weight"] = quantize(params["indexer"][name]["weight"]).replace(scale_fmt="ue8m0")
    params["indexer"]["k_norm"] = {"weight": jnp.asarray(1 + 0.2 * rng.normal(size=config.index_head_dim), jnp.float32),
                                   "bias": jnp.asarray(0.2 * rng.normal(size=config.index_head_dim), jnp.float32)}
    return params


def test_fp8_index_scores_follow_deepseeks_kernel():
    """FP8-kept weights: Hadamard rotation, ue8m0 FP8 queries and keys and fp8_index's formula, as
    DeepSeek's inference code (numpy, from its Indexer and kernels) scores them."""
    config = V32_TINY.replace(index_head_dim=128, index_n_heads=8, rope_scaling=None, qk_rope_head_dim=8)
    rng = np.random.default_rng(0)
    params = _fp8_indexer_params(config, rng)
    x = rng.normal(size=(2, 10, config.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(10, dtype=np.int32), (2, 10))

    def scores(mla, x):
        q_resid = mla.q_a_layernorm(mla.down_projections(x)[0])
        queries, weights = mla.indexer.queries(x, q_resid, positions)
        causal = positions[:, None, :] <= positions[:, :, None]
        return indexer.scores(mla.config, queries, weights, mla.indexer.keys(x, positions), causal), q_resid

    got, q_resid = MLA(config).apply({"params": params}, jnp.asarray(x), method=scores)
    dense = {name: np.asarray(params["indexer"][name]["weight"].dequantize()) for name in ("wq_b", "wk")}
    dense.update(k_norm_weight=np.asarray(params["indexer"]["k_norm"]["weight"]),
                 k_norm_bias=np.asarray(params["indexer"]["k_norm"]["bias"]),
                 weights_proj=np.asarray(params["indexer"]["weights_proj"]["weight"]))
    want = deepseek_reference.fp8_index_scores(x.astype(np.float64), np.asarray(q_resid, np.float64), positions,
                                               dense, config.index_n_heads, config.index_head_dim,
                                               config.qk_rope_head_dim, config.rope_theta)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    np.testing.assert_allclose(np.asarray(got)[finite], want[finite], rtol=2e-5, atol=2e-5 * np.abs(want[finite]).max())


def test_fp8_checkpoint_generates_what_its_full_forward_predicts(tmp_path):
    """A V3.2-style FP8 checkpoint (indexer wq_b and wk in FP8, ue8m0 scales) kept in FP8: greedy
    generation (cached, gathered keys) equals argmax of full forward passes over each prefix
    (uncached, masked keys), both with the FP8 indexer."""
    torch.manual_seed(0)
    config = ref.DeepseekV32Config(**dict(ref.FP8_CONFIG, index_n_heads=8, index_head_dim=128, index_topk=5))
    config._attn_implementation = "eager"
    main = ref.DeepseekV32ForCausalLM(config).eval()
    ref.randomize(main, 0)
    ref.save_fp8(main, None, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw["quantization_config"]["scale_fmt"] = "ue8m0"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    model = jaxmtp.load(str(tmp_path), quantized="keep", matmul="dequant", quiet=True)
    weight = model.params["dense_layers"]["layers"]["self_attn"]["indexer"]["wk"]["weight"]
    assert weight.value.dtype == jnp.float8_e4m3fn and weight.rounds_scales
    prompts = [np.random.default_rng(3).integers(0, config.vocab_size, n).tolist() for n in (9, 14)]
    got = jaxmtp.generate(model, prompts, max_new_tokens=6, eos_token_id=None).tokens
    width = max(PROMPT_LENGTHS)
    for prompt, tokens in zip(prompts, got):
        sequence = list(prompt)
        for _ in range(6):  # right-padded: a causal pass's logits at a position ignore what follows it
            logits, _ = model.forward(np.asarray([sequence + [0] * (width - len(sequence))]))
            sequence.append(int(np.argmax(np.asarray(logits)[0, len(sequence) - 1])))
        assert tokens == sequence[len(prompt):]


def test_published_config_loads_counts_and_round_trips():
    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v32_671b.json")
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (64, 128, 2048)
    assert config.quantization.scale_fmt == "ue8m0" and config.has_mtp
    raw = config.to_hf_config()
    assert raw["architectures"] == ["DeepseekV32ForCausalLM"] and "rope_interleave" not in raw
    assert jaxmtp.ModelConfig.from_hf_config(raw) == config
    hf = ref.DeepseekV32Config(**{k: v for k, v in raw.items() if k != "quantization_config"})
    assert (hf.index_topk, hf.num_hidden_layers, hf.q_lora_rank) == (2048, 61, 1536)
    counts = parameter_counts(config)
    v3 = parameter_counts(jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v3_671b.json"))
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64  # wq_b, wk, k_norm, weights_proj
    assert counts["main"] - v3["main"] == 61 * per_layer and counts["mtp_unique"] - v3["mtp_unique"] == per_layer


@pytest.mark.parametrize("change, message", [
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(index_head_dim=6), "index_head_dim"),
    (dict(index_topk=0), "index_topk"),
    (dict(mlp_layer_types=["sparse"] * 61), "mlp_layer_types"),
])
def test_bad_indexer_fields_are_named(change, message):
    with open(f"{jaxmtp.CONFIGS}/deepseek_v32_671b.json") as f:
        raw = json.load(f)
    with pytest.raises(ConfigError, match=message):
        jaxmtp.ModelConfig.from_hf_config(dict(raw, **change))


def test_cache_holds_the_index_keys():
    from jaxmtp.cache import bytes_per_token

    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v32_671b.json")
    assert bytes_per_token(config) == (512 + 64 + 128) * 2


def test_generation_on_a_data_parallel_mesh_selects_per_row():
    """Rows, caches and the indexer's top-k split over data=8 (each device selects for its own rows):
    the tokens of one device."""
    from jaxmtp.params import param_shardings
    from jaxmtp.sharding import make_mesh, place

    config = V32_TINY.replace(num_attention_heads=8, q_lora_rank=32)
    single = gm.model("partial", config)
    mesh = make_mesh(data=8)
    sharded = jaxmtp.Model(config, place(single.params, param_shardings(config, single.params, mesh)), mesh)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (3, 9, 17, 30, 6, 12, 25, 8)]
    want = jaxmtp.generate(single, prompts, max_new_tokens=6, speculative_k=2, eos_token_id=None).tokens
    assert jaxmtp.generate(sharded, prompts, max_new_tokens=6, speculative_k=2, eos_token_id=None).tokens == want

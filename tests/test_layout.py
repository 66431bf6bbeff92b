"""The decode layout (unrolled layers, split experts, [in, out] weights, joint projections,
absorbed queries) computes the same model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import generation_models as gm
import jaxmtp
from jaxmtp.layout import (CHECKPOINT, FINE_PREFIXES_BELOW, MANY_QUERIES, SHORTEST_PREFIX, Layout,
                           absorbing_is_no_larger, decode_layout, prefix_lengths)
from jaxmtp.quant import QuantizedWeight, quantize_params

TOKENS = np.random.default_rng(3).integers(0, gm.TINY.vocab_size, (2, 24))


def _relative(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


ABSORBED = Layout(unrolled=True, split_experts=True, inputs_first=True, joint_projections=True, absorbed_queries=True)


@pytest.mark.parametrize("layout, q_lora_rank", [
    (Layout(unrolled=True), gm.TINY.q_lora_rank), (Layout(unrolled=True, inputs_first=True), gm.TINY.q_lora_rank),
    (Layout(unrolled=True, inputs_first=True, joint_projections=True), gm.TINY.q_lora_rank),
    (Layout(unrolled=True, split_experts=True, inputs_first=True), gm.TINY.q_lora_rank),
    (Layout(unrolled=True, split_experts=True, inputs_first=True, joint_projections=True), gm.TINY.q_lora_rank),
    (ABSORBED, gm.TINY.q_lora_rank), (ABSORBED, None)])  # q_b_proj, or q_proj without a query LoRA, absorbed
def test_forward_and_mtp_equal_the_checkpoint_layout(layout, q_lora_rank):
    model = gm.model("random", gm.TINY.replace(q_lora_rank=q_lora_rank))
    converted = model.with_layout(layout)
    logits, hidden = model.forward(TOKENS)
    got_logits, got_hidden = converted.forward(TOKENS)
    assert _relative(got_logits, logits) < 1e-5 and _relative(got_hidden, hidden) < 1e-5
    assert _relative(converted.mtp_forward(hidden, TOKENS), model.mtp_forward(hidden, TOKENS)) < 1e-5


def test_converted_parameters_are_the_checkpoint_tensors_rearranged():
    model = gm.model("random")
    dense = model.with_layout(decode_layout(model.config, model.params))
    assert dense.layout == Layout(unrolled=True, split_experts=True, inputs_first=True, prefix_attention=True,
                                  joint_projections=True)
    stacked, layer = model.params["moe_layers"]["layers"], dense.params["moe_layers"]["layers_1"]
    np.testing.assert_array_equal(layer["self_attn"]["q_b_proj"]["weight"], stacked["self_attn"]["q_b_proj"]["weight"][1].T)
    attention = stacked["self_attn"]  # joint: q_a_proj's columns, then kv_a_proj_with_mqa's
    np.testing.assert_array_equal(layer["self_attn"]["qkv_a_proj"]["weight"], np.concatenate(
        [attention["q_a_proj"]["weight"][1].T, attention["kv_a_proj_with_mqa"]["weight"][1].T], axis=1))
    shared = stacked["mlp"]["shared_experts"]
    np.testing.assert_array_equal(layer["mlp"]["shared_experts"]["gate_up_proj"]["weight"], np.concatenate(
        [shared["gate_proj"]["weight"][1].T, shared["up_proj"]["weight"][1].T], axis=1))
    experts = stacked["mlp"]["experts"]
    np.testing.assert_array_equal(layer["mlp"]["experts"]["gate_up_proj"][5], np.concatenate(
        [experts["gate_proj"][1, 5].T, experts["up_proj"][1, 5].T], axis=1))
    c = model.config  # kv_b_proj's rows are per head: N key rows, then V value rows
    per_head = stacked["self_attn"]["kv_b_proj"]["weight"][1].reshape(c.num_attention_heads, -1, c.kv_lora_rank)
    np.testing.assert_array_equal(layer["self_attn"]["kv_b_proj"]["key"], per_head[:, :c.qk_nope_head_dim])
    # the value half maps the latent to values: stored latent (its input) first, [H, C, V]
    np.testing.assert_array_equal(layer["self_attn"]["kv_b_proj"]["value"],
                                  per_head[:, c.qk_nope_head_dim:].transpose(0, 2, 1))
    assert per_head.shape[1] == c.qk_nope_head_dim + c.v_head_dim
    np.testing.assert_array_equal(layer["mlp"]["experts"]["down_proj"][5], stacked["mlp"]["experts"]["down_proj"][1, 5].T)
    np.testing.assert_array_equal(layer["mlp"]["gate"]["weight"], stacked["mlp"]["gate"]["weight"][1].T)
    np.testing.assert_array_equal(dense.params["lm_head"]["weight"], model.params["lm_head"]["weight"].T)
    np.testing.assert_array_equal(dense.params["embed_tokens"]["weight"], model.params["embed_tokens"]["weight"])


@pytest.mark.parametrize("q_lora_rank", [gm.TINY.q_lora_rank, None])
def test_absorbed_queries_are_the_query_projection_times_w_uk(q_lora_rank):
    """Per head h: the nope columns of the query projection times W_uk[h] (float64 numpy), then the
    rope columns as they were; kv_b_proj keeps W_uv only."""
    model = gm.model("random", gm.TINY.replace(q_lora_rank=q_lora_rank))
    c, name = model.config, "q_proj" if q_lora_rank is None else "q_b_proj"
    absorbed = model.with_layout(Layout(unrolled=True, inputs_first=True, absorbed_queries=True))
    stacked, layer = model.params["dense_layers"]["layers"]["self_attn"], absorbed.params["dense_layers"]["layers_0"]
    query = np.asarray(stacked[name]["weight"][0], np.float64).T.reshape(-1, c.num_attention_heads, c.qk_head_dim)
    kv_b = np.asarray(stacked["kv_b_proj"]["weight"][0], np.float64).reshape(c.num_attention_heads, -1, c.kv_lora_rank)
    w_uk = kv_b[:, :c.qk_nope_head_dim]  # [H, N, C]
    latent = np.stack([query[:, h, :c.qk_nope_head_dim] @ w_uk[h] for h in range(c.num_attention_heads)], axis=1)
    expected = np.concatenate([latent, query[:, :, c.qk_nope_head_dim:]], axis=-1).reshape(query.shape[0], -1)
    np.testing.assert_allclose(layer["self_attn"][name]["weight"], expected, rtol=1e-5, atol=1e-7)
    assert set(layer["self_attn"]["kv_b_proj"]) == {"value"}


def test_queries_are_absorbed_where_that_stores_no_more_numbers():
    """[Q, H * (C + R)] against [Q, H * (N + R)] plus W_uk [H, N, C]."""
    demo = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/demo.json")  # 64*4*80 = 64*4*48 + 4*32*64
    v3 = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v3_671b.json")  # 2.5x: stays apart
    assert absorbing_is_no_larger(demo) and not absorbing_is_no_larger(v3)
    assert not absorbing_is_no_larger(demo.replace(kv_lora_rank=65))
    params = gm.model("random").params
    assert decode_layout(gm.TINY, params).absorbed_queries == absorbing_is_no_larger(gm.TINY)


def test_fp8_kept_weights_are_only_unrolled_and_still_exact():
    model = gm.model("random")
    fp8 = jaxmtp.Model(model.config, quantize_params(model.params))
    layout = decode_layout(fp8.config, fp8.params)
    assert layout == Layout(unrolled=True, prefix_attention=True)
    converted = fp8.with_layout(layout)
    weight = converted.params["moe_layers"]["layers_0"]["self_attn"]["o_proj"]["weight"]
    assert isinstance(weight, QuantizedWeight) and weight.value.ndim == 2
    assert _relative(converted.forward(TOKENS)[0], fp8.forward(TOKENS)[0]) < 1e-5
    with pytest.raises(ValueError, match="cannot be joined or folded"):
        fp8.with_layout(Layout(unrolled=True, inputs_first=True, joint_projections=True))
    with pytest.raises(ValueError, match="cannot be joined or folded"):
        fp8.with_layout(Layout(unrolled=True, inputs_first=True, absorbed_queries=True))


def test_a_mesh_that_runs_experts_in_parallel_keeps_them_stacked():
    from jaxmtp.sharding import make_mesh

    params = gm.model("random").params
    assert not decode_layout(gm.TINY, params, make_mesh(expert=2, tensor=4)).split_experts
    # `data` splits the experts too (data-parallel attention beside expert-parallel MoE).
    assert not decode_layout(gm.TINY, params, make_mesh(data=8)).split_experts
    # Weights split over `tensor` stay apart: a device's slice of a joint one is not what each half needs.
    assert not decode_layout(gm.TINY, params, make_mesh(data=2, tensor=4)).joint_projections
    assert decode_layout(gm.TINY, params, make_mesh(expert=8)).joint_projections


def test_experts_stay_stacked_on_a_gpu():
    """XLA:GPU fetches every conditional's predicate to the host: no conditional per expert there."""
    import types

    gpu = types.SimpleNamespace(shape={"data": 1}, devices=np.array([types.SimpleNamespace(platform="gpu")]))
    layout = decode_layout(gm.TINY, gm.model("random").params, gpu)
    assert layout == Layout(unrolled=True, inputs_first=True, joint_projections=True)


def test_layout_rules():
    with pytest.raises(ValueError, match="unrolled layers only"):
        Layout(inputs_first=True)
    with pytest.raises(ValueError, match="needs inputs_first"):
        Layout(unrolled=True, joint_projections=True)
    with pytest.raises(ValueError, match="needs inputs_first"):
        Layout(unrolled=True, absorbed_queries=True)
    model = gm.model("random")
    assert model.decoding() is model.decoding()  # converted once, kept
    assert model.decoding().decoding() is model.decoding()
    with pytest.raises(ValueError, match="from the checkpoint layout only"):
        model.decoding().with_layout(CHECKPOINT)


@pytest.mark.parametrize("cache_len", [96, 256, 384, 608, 640, 1152, 4096, 5120])
def test_prefix_lengths(cache_len):
    """A decode step chooses among prefixes of at most half the cache (a longer one is copied out
    for less than it saves), then the whole cache; a prefill chunk among prefixes whose steps grow
    by at most 1.5x below FINE_PREFIXES_BELOW, then the decode steps' doubling. Every pass has one
    that holds its last position: the last is the whole cache."""
    decode, chunk = prefix_lengths(cache_len), prefix_lengths(cache_len, queries=MANY_QUERIES)
    for lengths in decode, chunk:
        assert lengths[-1] == cache_len and list(lengths) == sorted(set(lengths))
    assert all(2 * n <= cache_len and n % SHORTEST_PREFIX == 0 for n in decode[:-1])
    fine = [n for n in chunk if n < min(cache_len, FINE_PREFIXES_BELOW)]
    if fine:
        assert fine[0] == SHORTEST_PREFIX // 2
        assert all(b <= 1.5 * a for a, b in zip(fine, fine[1:] + [min(cache_len, FINE_PREFIXES_BELOW)]))
    assert [n for n in chunk if n >= FINE_PREFIXES_BELOW] == [n for n in decode if n >= FINE_PREFIXES_BELOW]


def test_split_experts_match_the_per_token_formula():
    from numpy_reference import reference_experts

    from jaxmtp.moe import split_experts

    rng = np.random.default_rng(0)
    rows_per_expert = set()  # each expert runs on no row, one row, or all rows
    for tokens in (1, 3, 9):
        x = rng.normal(size=(tokens, 16)).astype(np.float32)
        gate, up = (rng.normal(size=(8, 8, 16)).astype(np.float32) for _ in range(2))
        down = rng.normal(size=(8, 16, 8)).astype(np.float32)
        experts = np.stack([rng.choice(8, 2, replace=False) for _ in range(tokens)]).astype(np.int32)
        weights = rng.uniform(0.1, 2.0, (tokens, 2)).astype(np.float32)
        rows_per_expert |= {(tokens > 1, min(n, 2)) for n in np.bincount(experts.ravel(), minlength=8)}
        want = reference_experts(x, weights, experts, gate, up, down)
        out_in = tuple(map(jnp.asarray, gate)), tuple(map(jnp.asarray, up)), tuple(map(jnp.asarray, down))
        in_out = tuple(tuple(jnp.asarray(e.T) for e in w) for w in (gate, up, down))
        joint = tuple(jnp.concatenate([g, u], axis=1) for g, u in zip(*in_out[:2])), (None,) * 8, in_out[2]
        for (g, u, d), inputs_first in ((out_in, False), (in_out, True), (joint, True)):
            got = jax.jit(split_experts, static_argnums=6)(x, weights, experts, g, u, d, inputs_first)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert rows_per_expert >= {(True, 0), (True, 1), (True, 2)}, rows_per_expert  # every branch of several rows ran


def test_save_refuses_the_decode_layout(tmp_path):
    with pytest.raises(ValueError, match="decode layout"):
        jaxmtp.save(gm.model("random").decoding(), tmp_path / "m")

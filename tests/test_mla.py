"""The expanded (prefill) and absorbed (decode) MLA forms over the same compressed cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp
from jaxmtp import layout
from jaxmtp.cache import MLACache, bytes_per_token
from jaxmtp.layout import prefix_lengths
from jaxmtp.mla import MLA
from jaxmtp.params import module

CONFIG = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json")


def _relative_error(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.mark.parametrize("q_lora_rank", [48, None])
@pytest.mark.parametrize("batch, rows", [(3, 4), (1, 4), (1, 1)])
def test_expanded_and_absorbed_agree_over_one_cache(q_lora_rank, batch, rows):
    """One row's cache is written by a dynamic_update_slice, several rows' by a scatter; one query
    row's absorbed form contracts in another order than several rows' (MLA.attend_absorbed)."""
    cfg = CONFIG.replace(q_lora_rank=q_lora_rank)
    max_len = 24
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, rows, cfg.hidden_size)), jnp.float32)
    # Each row continues its own sequence: queries at different absolute positions.
    positions = jnp.asarray([5, 0, 15][:batch], jnp.int32)[:, None] + jnp.arange(rows, dtype=jnp.int32)
    cache = MLACache(c_kv=jnp.asarray(rng.normal(size=(batch, max_len, cfg.kv_lora_rank)), jnp.float32),
                     k_pe=jnp.asarray(rng.normal(size=(batch, max_len, cfg.qk_rope_head_dim)), jnp.float32))
    params = MLA(cfg).init(jax.random.key(1), x, positions, cache)
    params = jax.tree.map(lambda p: p * 10.0, params)  # O(1) weights: attention far from uniform
    out_expanded, cache_expanded = MLA(cfg, absorbed=False).apply(params, x, positions, cache)
    out_absorbed, cache_absorbed = MLA(cfg, absorbed=True).apply(params, x, positions, cache)
    assert _relative_error(out_absorbed, out_expanded) <= 1e-5
    np.testing.assert_array_equal(cache_absorbed.c_kv, cache_expanded.c_kv)
    # The new entries landed at the query positions and nowhere else.
    changed = np.any(np.asarray(cache_expanded.c_kv) != np.asarray(cache.c_kv), axis=-1)
    expected = np.zeros((batch, max_len), bool)
    expected[np.arange(batch)[:, None], np.asarray(positions)] = True
    np.testing.assert_array_equal(changed, expected)


def test_cached_absorbed_decode_equals_uncached_forward():
    """Prefill 10 tokens into the cache, then decode 6 one by one in absorbed form: every logit row
    equals the one-shot causal forward over all 16 tokens."""
    model = jaxmtp.init(CONFIG, seed=3)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, 16)), jnp.int32)
    full_logits, _ = model.forward(tokens)
    caches = {g: MLACache.zeros(CONFIG, n, 2, 32) for g, n in
              (("dense", CONFIG.num_dense_layers), ("moe", CONFIG.num_moe_layers))}
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    apply = jax.jit(lambda p, t, pos, c, absorbed: module(CONFIG, absorbed=absorbed).apply({"params": p}, t, pos, c),
                    static_argnums=4)
    logits, _, caches = apply(model.params, tokens[:, :10], positions[:, :10], caches, False)
    rows = [logits]
    for t in range(10, 16):
        step_logits, _, caches = apply(model.params, tokens[:, t:t + 1], positions[:, t:t + 1], caches, True)
        rows.append(step_logits)
    assert _relative_error(jnp.concatenate(rows, axis=1), full_logits) <= 1e-5


@pytest.mark.parametrize("batch, absorbed_queries", [(2, False), (1, True)])
def test_prefix_attention_decode_equals_uncached_forward(monkeypatch, batch, absorbed_queries):
    """The CPU decode layout attends over the cache's shortest prefix that holds the query
    positions (64, 128 or 256 of 256 slots here, with prefixes from 64 slots; passes of 16 or more
    positions from finer ones: 32, 48, 64, 96, 128, 192, 256). Prefill 60 tokens, then decode one
    by one, with a 3-row pass across slot 64, a 20-row one across slot 96 and a 3-row one across
    slot 128: every logit row equals the one-shot causal forward (checkpoint layout, no cache) over
    all 140 tokens.
    Batch 1 writes its caches by dynamic_update_slice, batch 2 by scatter (MLACache.write); batch 1
    runs with W_uk folded into the query projection (layout.absorbed_queries), prefill included."""
    monkeypatch.setattr(layout, "SHORTEST_PREFIX", 64)  # read when `apply` below is traced
    model = jaxmtp.init(CONFIG, seed=3)
    decoding = model.with_layout(dataclasses.replace(model.decoding().layout, absorbed_queries=absorbed_queries))
    assert decoding.layout.prefix_attention and prefix_lengths(256) == (64, 128, 256)
    assert prefix_lengths(256, queries=20) == (32, 48, 64, 96, 128, 192, 256)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, CONFIG.vocab_size, (batch, 140)), jnp.int32)
    full_logits, _ = model.forward(tokens)
    caches = {g: tuple(MLACache.zeros(CONFIG, None, batch, 256) for _ in range(n)) for g, n in
              (("dense", CONFIG.num_dense_layers), ("moe", CONFIG.num_moe_layers))}
    positions = jnp.broadcast_to(jnp.arange(140), (batch, 140))
    apply = jax.jit(lambda p, t, pos, c, absorbed: module(CONFIG, absorbed=absorbed, layout=decoding.layout).apply(
        {"params": p}, t, pos, c), static_argnums=4)
    # chunk i: positions starts[i]..starts[i + 1] - 1
    starts = [0, *range(60, 63), 63, *range(66, 90), 90, *range(110, 126), 126, *range(129, 141)]
    rows = []
    for start, stop in zip(starts, starts[1:]):
        logits, _, caches = apply(decoding.params, tokens[:, start:stop], positions[:, start:stop], caches, start > 0)
        rows.append(logits)
    assert _relative_error(jnp.concatenate(rows, axis=1), full_logits) <= 1e-5


def test_cache_bytes_per_token_for_deepseek_v3():
    v3 = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/deepseek_v3_671b.json")
    assert v3.cache_width == 576  # 512 latent + 64 rope key
    assert bytes_per_token(v3, jnp.bfloat16) == 1152

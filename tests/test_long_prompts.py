"""Long prompts: the chunked prefill and blockwise attention compute what one pass over the whole
prompt and whole-cache attention compute (both checked against HF transformers elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import generation_models as gm
import jaxmtp
from jaxmtp import layout, mla
from jaxmtp.cache import MLACache
from jaxmtp.mla import MLA

CONFIG = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json")
PROMPTS = [np.random.default_rng(1).integers(0, gm.TINY.vocab_size, n).tolist() for n in (70, 33, 5)]


def _max_difference(a, b):
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_blockwise_attention_equals_whole_cache_attention(monkeypatch, absorbed, q_lora_rank):
    """Rows at different positions (one whose queries see only the first key block), float32."""
    cfg = CONFIG.replace(q_lora_rank=q_lora_rank)
    rng = np.random.default_rng(0)
    batch, rows, slots = 3, 40, 128
    x = jnp.asarray(rng.normal(size=(batch, rows, cfg.hidden_size)), jnp.float32)
    positions = jnp.asarray([0, 50, 88], jnp.int32)[:, None] + jnp.arange(rows, dtype=jnp.int32)
    cache = MLACache(c_kv=jnp.asarray(rng.normal(size=(batch, slots, cfg.kv_lora_rank)), jnp.float32),
                     k_pe=jnp.asarray(rng.normal(size=(batch, slots, cfg.qk_rope_head_dim)), jnp.float32))
    params = jax.tree.map(lambda p: p * 10.0, MLA(cfg).init(jax.random.key(1), x, positions, cache))
    whole, whole_cache = MLA(cfg, absorbed=absorbed).apply(params, x, positions, cache)
    monkeypatch.setattr(mla, "KEY_BLOCK", 32)
    assert mla.blockwise(rows, slots)
    blocks, blocks_cache = MLA(cfg, absorbed=absorbed).apply(params, x, positions, cache)
    np.testing.assert_allclose(blocks, whole, rtol=1e-5, atol=1e-5 * float(jnp.abs(whole).max()))
    np.testing.assert_array_equal(blocks_cache.c_kv, whole_cache.c_kv)


def _model(kind: str, stacked: bool, monkeypatch) -> jaxmtp.Model:
    """A fresh Model (no decode copy cached) that decodes unrolled, or in its stacked checkpoint
    layout as the large models do."""
    if stacked:
        monkeypatch.setattr(layout, "MAX_UNROLLED_BYTES", 0)
    base = gm.model(kind)
    return jaxmtp.Model(base.config, base.params)


@pytest.mark.parametrize("stacked, k", [(False, "auto"), (True, 0), (True, 2)])
def test_chunked_prefill_equals_one_pass(monkeypatch, stacked, k):
    """Prompts of 5, 33 and 70 tokens (a ragged batch) prefilled 16 positions at a time, with
    attention over the cache blockwise: the same greedy tokens and log-probabilities within 1e-5."""
    model = _model("partial", stacked, monkeypatch)
    whole = jaxmtp.generate(model, PROMPTS, max_new_tokens=8, speculative_k=k, return_logprobs=True)
    monkeypatch.setattr(mla, "KEY_BLOCK", 32)
    chunked = jaxmtp.generate(model, PROMPTS, max_new_tokens=8, speculative_k=k, return_logprobs=True,
                              prefill_chunk=16)
    assert chunked.tokens == whole.tokens
    assert _max_difference(chunked.logprobs, whole.logprobs) < 1e-5


def test_chunked_prefill_samples_what_one_pass_samples():
    """Speculative sampling draws the same tokens from the same seed: the first token and d1 are
    chosen with the keys of the one-pass prefill, from the same distributions."""
    model = gm.model("partial")
    options = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, speculative_k=2, seed=3)
    whole = jaxmtp.generate(model, PROMPTS, **options)
    chunked = jaxmtp.generate(model, PROMPTS, prefill_chunk=32, **options)
    assert chunked.tokens == whole.tokens


def test_prefill_chunk_is_checked():
    model = gm.model("partial")
    for chunk, message in [(8, "prefill_chunk"), (40, "multiple of 16")]:
        with pytest.raises(ValueError, match=message):
            jaxmtp.generate(model, PROMPTS, max_new_tokens=2, prefill_chunk=chunk)


def test_chunked_prefill_writes_the_caches_of_one_pass(monkeypatch):
    """Every cache entry a prompt position writes (main layers and MTP layer, every row up to its
    length), the first token's log-probability and d1's MTP hidden state, within 1e-5."""
    from jaxmtp.decoding import start
    from jaxmtp.generation import prepare

    model = gm.model("partial")
    options = dict(max_new_tokens=4, speculative_k=2, return_logprobs=True)
    whole = prepare(model, PROMPTS, **options)
    monkeypatch.setattr(mla, "KEY_BLOCK", 32)
    chunked = prepare(model, PROMPTS, prefill_chunk=16, **options)
    a, b = (start(p.static, p.params, p.inputs) for p in (whole, chunked))
    for row, length in enumerate(whole.lengths[:len(PROMPTS)]):
        for got, want in zip(jax.tree.leaves((b.caches, b.drafts.cache)), jax.tree.leaves((a.caches, a.drafts.cache))):
            np.testing.assert_allclose(got[row, :length], want[row, :length], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(b.tokens.logprobs, a.tokens.logprobs, atol=1e-5)
    np.testing.assert_allclose(b.drafts.hidden, a.drafts.hidden, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(b.drafts.token, a.drafts.token)


def test_chunked_prefill_on_a_data_parallel_mesh(monkeypatch):
    """Rows and caches split over data=8 (experts too), prompts several chunks long: the tokens of
    one device."""
    from jaxmtp.params import param_shardings
    from jaxmtp.sharding import make_mesh, place

    config = gm.TINY.replace(num_attention_heads=8, q_lora_rank=32)
    single = gm.model("partial", config)
    mesh = make_mesh(data=8)
    sharded = jaxmtp.Model(config, place(single.params, param_shardings(config, single.params, mesh)), mesh)
    prompts = PROMPTS + [[5] * 40, [9, 8, 7], [300] * 20, [1], [2, 3] * 30]
    want = jaxmtp.generate(single, prompts, max_new_tokens=6, speculative_k=2).tokens
    monkeypatch.setattr(mla, "KEY_BLOCK", 32)
    assert jaxmtp.generate(sharded, prompts, max_new_tokens=6, speculative_k=2, prefill_chunk=16).tokens == want


@pytest.mark.parametrize("k", [0, 3])
def test_decode_and_verify_passes_over_a_long_cache_attend_blockwise(monkeypatch, k):
    """Decode steps (one row) and verify passes (k + 1 rows) over caches past MAX_DECODE_SCORES
    attend blockwise: the tokens of whole-cache attention."""
    model = gm.model("partial")
    want = jaxmtp.generate(model, PROMPTS, max_new_tokens=8, speculative_k=k).tokens
    monkeypatch.setattr(mla, "KEY_BLOCK", 16)
    monkeypatch.setattr(mla, "MAX_DECODE_SCORES", 64)
    assert mla.blockwise(1, 128) and mla.blockwise(k + 1, 128)
    assert jaxmtp.generate(model, PROMPTS, max_new_tokens=8, speculative_k=k, prefill_chunk=32).tokens == want

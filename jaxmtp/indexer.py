"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): which cached keys each query reads.

A few cheap heads score every key s for each query t:

    score[t, s] = sum_h w[t, h] * relu(D^-0.5 * q[t, h] . k[s]),   w = weights_proj(x) * H^-0.5

with q = wq_b(q_resid) (q_resid: the query LoRA's normed output that MLA's q_b_proj reads too) and
k = k_norm(wk(x)), the first qk_rope_head_dim dims of both rotated as halves (MLA's own rotation
is interleaved). Of the keys at or before the query's position, the index_topk with the highest
score are the ones MLA attends to; a pass that sees no more than index_topk keys attends to all of
them, so the indexer matters only past index_topk cached tokens.

Where the weights are kept in FP8, q and k are quantized as DeepSeek's own inference code does
(inference/model.py of DeepSeek-V3.2-Exp): rotated by a normalised Hadamard matrix (orthogonal, so
dot products are unchanged in exact arithmetic), then cast to FP8 with one scale per vector (a power
of two under scale_fmt "ue8m0"). The cache keeps such keys dequantized, in the cache's dtype (exact
in bfloat16 for power-of-two scales).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.config import ModelConfig
from jaxmtp.errors import InputError
from jaxmtp.layers import Dtype, LayerNorm, Linear
from jaxmtp.layout import CHECKPOINT, Layout
from jaxmtp.quant import QuantizedWeight
from jaxmtp.rope import apply_rope
from jaxmtp.sharding import over_data_rows
from pallas_kernels.reference import act_quant_reference

# Index scores over more than this many [T, H, S] per-head entries per batch row are computed a
# KEY_BLOCK of keys at a time (a 512-position prefill chunk against a 128K cache would otherwise hold
# 17 GB of them at DeepSeek-V3.2's 64 heads).
MAX_HEAD_SCORES = 1 << 24
KEY_BLOCK = 1024


class Indexer(nn.Module):
    """One attention layer's lightning indexer: its index queries, head weights and keys.

    Args of the methods: x [B, T, D] (the attention's normed input), q_resid [B, T, Q],
    positions [B, T]."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    layout: Layout = CHECKPOINT

    def setup(self):
        c = self.config
        lin = lambda i, o, axes: Linear(i, o, axes, self.dtype, c.initializer_range, layout=self.layout)  # noqa: E731
        self.wq_b = lin(c.q_lora_rank, c.index_n_heads * c.index_head_dim, ("index_heads", "q_lora"))
        self.wk = lin(c.hidden_size, c.index_head_dim, ("index_head_dim", "embed"))
        self.k_norm = LayerNorm(c.index_head_dim, 1e-6, self.dtype)
        self.weights_proj = lin(c.hidden_size, c.index_n_heads, ("index_heads", "embed"))

    def keys(self, x, positions):
        """-> the index keys of the T new tokens [B, T, Di], as the cache keeps them."""
        return self._prepared(self._rotated(self.k_norm(self.wk(x)), positions))

    def queries(self, x, q_resid, positions):
        """-> (index queries [B, T, Hi, Di], their head weights w [B, T, Hi] float32)."""
        c = self.config
        q = self.wq_b(q_resid)
        q = self._prepared(self._rotated(q.reshape(q.shape[:2] + (c.index_n_heads, c.index_head_dim)), positions))
        weights = self.weights_proj(x).astype(jnp.float32) * c.index_n_heads ** -0.5
        return q, weights

    def _rotated(self, v, positions):
        """RoPE (halves, not pairs) on the first qk_rope_head_dim dims of v [B, T, ..., Di]."""
        rope = self.config.qk_rope_head_dim
        return jnp.concatenate([apply_rope(v[..., :rope], positions, self.config, interleave=False), v[..., rope:]],
                               axis=-1)

    def _prepared(self, v):
        """v [..., Di] as it is scored: itself, or with FP8-kept weights Hadamard-rotated and
        round-tripped through FP8 with one scale per vector, as DeepSeek's kernel scores it."""
        weight = self.wk.weight
        if not isinstance(weight, QuantizedWeight):
            return v
        rotated = jnp.einsum("...d,de->...e", v.astype(jnp.float32), jnp.asarray(hadamard(v.shape[-1])),
                             precision=jax.lax.Precision.HIGHEST).astype(v.dtype)
        values, scales = act_quant_reference(rotated, weight.rounds_scales)
        return (values.astype(jnp.float32) * jnp.repeat(scales, 128, axis=-1)[..., :v.shape[-1]]).astype(v.dtype)


def hadamard(n: int) -> np.ndarray:
    """The normalised Sylvester-Hadamard matrix [n, n] (n a power of two), symmetric and orthogonal."""
    if n & (n - 1):
        raise InputError(f"hadamard: the FP8 indexer rotates index_head_dim = {n}, which must be a power of two")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def scores(config: ModelConfig, queries, weights, keys, visible):
    """Index scores of queries [B, T, Hi, Di] (weights [B, T, Hi]) against keys [B, S, Di] where
    visible [B, T, S], else -inf. -> [B, T, S] float32. Above MAX_HEAD_SCORES per-head entries a
    row, one KEY_BLOCK of keys at a time."""
    scale = config.index_head_dim ** -0.5

    def over(k):  # keys [B, K, Di] -> [B, T, K]
        per_head = jnp.einsum("bthd,bkd->bthk", queries, k.astype(queries.dtype), preferred_element_type=jnp.float32)
        return jnp.einsum("bthk,bth->btk", jax.nn.relu(per_head * scale), weights)

    b, t, h, _ = queries.shape
    s = keys.shape[1]
    if t * h * s <= MAX_HEAD_SCORES or s % KEY_BLOCK:
        return jnp.where(visible, over(keys), -jnp.inf)

    def block(j, out):
        k = jax.lax.dynamic_slice_in_dim(keys, j * KEY_BLOCK, KEY_BLOCK, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(out, over(k), j * KEY_BLOCK, axis=2)

    out = jax.lax.fori_loop(0, s // KEY_BLOCK, block, jnp.zeros((b, t, s), jnp.float32))
    return jnp.where(visible, out, -jnp.inf)


def top_keys(config: ModelConfig, index_scores):
    """index_scores [B, T, S] -> (indices [B, T, K] of the K = min(index_topk, S) highest, chosen
    [B, T, K]: whether each is a visible key). Equal scores: the lower index first. Each device
    selects for its own rows, because XLA runs top_k on the whole batch on every device of a data mesh."""
    def select(index_scores):
        values, indices = jax.lax.top_k(index_scores, min(config.index_topk, index_scores.shape[-1]))
        return indices, values > -jnp.inf

    return over_data_rows(select, index_scores)


def selected_mask(indices, chosen, slots: int):
    """The chosen keys as a mask [B, T, slots]."""
    def scatter(indices, chosen):
        b, t, _ = indices.shape
        mask = jnp.zeros((b, t, slots), bool)
        return mask.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], indices].set(
            chosen, mode="promise_in_bounds", unique_indices=True)

    return over_data_rows(scatter, indices, chosen)

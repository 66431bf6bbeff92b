"""DeepSeek-V4's building blocks besides attention: rotary embedding on the trailing dims,
manifold-constrained hyper-connections (mHC, several residual streams) and the MoE with hash or
top-k routing over `sqrt(softplus)` scores and clamped SwiGLU experts.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.layers import Dtype, normal_init, projection_weight
from jaxmtp.layout import CHECKPOINT
from jaxmtp.models.deepseek_v4.config import HASH_MOE, SLIDING, V4Config
from jaxmtp.moe import MLP, Experts
from jaxmtp.quant import linear
from jaxmtp.rope import pair_frequencies


def frequencies(config: V4Config, layer_type: str) -> np.ndarray:
    """Pair frequencies [qk_rope_head_dim // 2]: sliding layers (and the MTP layer) at rope_theta
    without scaling; compressed layers, their compressors and indexers at compress_rope_theta with
    YaRN (without YaRN's scaling of cos and sin, as DeepSeek's reference)."""
    if layer_type == SLIDING:
        return pair_frequencies(config.qk_rope_head_dim, config.rope_theta, None)
    return pair_frequencies(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)


def rotate_tail(x, positions, freqs: np.ndarray, inverse: bool = False):
    """Rotates interleaved pairs (x[2i], x[2i+1]) of the trailing 2 * len(freqs) dims of x by their
    positions (by minus them with `inverse`), in float32; the leading dims are left as they are.
    x [B, T, ..., dim], positions [B, T] -> same shape and dtype."""
    r = 2 * len(freqs)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [B, T, r/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    pairs = x[..., -r:].astype(jnp.float32).reshape(x.shape[:-1] + (r // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape[:-1] + (r,))
    return jnp.concatenate([x[..., :-r], rotated.astype(x.dtype)], axis=-1)


def unit_rms(x, eps: float):
    """x / rms(x) over the last dim, in float32 (a weightless RMSNorm)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class HyperConnection(nn.Module):
    """mHC around one sublayer: from the streams X [B, T, N, D], float32 weights `fn` [(2+N)N, N*D],
    `base` [(2+N)N] and `scale` [3] give the input gate `pre` [B, T, N] (collapses the streams into the
    sublayer's input), the output gate `post` [B, T, N] and the mixing matrix `comb` [B, T, N, N]
    (softmax rows, then Sinkhorn normalisation towards doubly stochastic)."""

    config: V4Config

    @nn.compact
    def __call__(self, streams):
        """streams [B, T, N, D] -> (sublayer input [B, T, D], post, comb)."""
        c = self.config
        n, width = c.hc_mult, c.hc_mult * c.hidden_size
        fn = self.param("fn", normal_init(c.initializer_range, ("hc_mix", "hc_embed")), ((2 + n) * n, width),
                        jnp.float32)
        base = self.param("base", nn.with_logical_partitioning(nn.initializers.zeros, ("hc_mix",)), ((2 + n) * n,),
                          jnp.float32)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (3,), jnp.float32)
        flat = unit_rms(streams.reshape(streams.shape[:2] + (width,)), c.rms_norm_eps)
        mix = jnp.einsum("bti,oi->bto", flat, fn)
        pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + c.hc_eps
        post = 2 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
        logits = mix[..., 2 * n:].reshape(mix.shape[:2] + (n, n)) * scale[2] + base[2 * n:].reshape(n, n)
        comb = sinkhorn(jax.nn.softmax(logits, axis=-1) + c.hc_eps, c.hc_sinkhorn_iters, c.hc_eps)
        collapsed = jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32)).astype(streams.dtype)
        return collapsed, post, comb


def sinkhorn(m, iterations: int, eps: float):
    """A column normalisation, then iterations - 1 rounds of row and column normalisation. m [..., N, N]."""
    def rows_then_columns(_, m):
        m = m / (m.sum(axis=-1, keepdims=True) + eps)
        return m / (m.sum(axis=-2, keepdims=True) + eps)

    m = m / (m.sum(axis=-2, keepdims=True) + eps)
    return jax.lax.fori_loop(0, iterations - 1, rows_then_columns, m)  # a loop: fewer ops to compile


def expand(streams, out, post, comb):
    """The streams after a sublayer: post[k] * out + sum_j comb[j, k] * streams[j].
    streams [B, T, N, D], out [B, T, D], post [B, T, N], comb [B, T, N, N] -> [B, T, N, D]."""
    dtype = streams.dtype
    return (post.astype(dtype)[..., None] * out[..., None, :]
            + jnp.einsum("btjk,btjd->btkd", comb.astype(dtype), streams))


class HyperHead(nn.Module):
    """The final collapse of the streams: sum_k pre[k] * X[k] with sigmoid gates from float32
    `hc_fn` [N, N*D], `hc_base` [N], `hc_scale` [1]. streams [B, T, N, D] -> [B, T, D]."""

    config: V4Config

    @nn.compact
    def __call__(self, streams):
        c = self.config
        n, width = c.hc_mult, c.hc_mult * c.hidden_size
        fn = self.param("hc_fn", normal_init(c.initializer_range, ("hc_streams", "hc_embed")), (n, width),
                        jnp.float32)
        base = self.param("hc_base", nn.with_logical_partitioning(nn.initializers.zeros, ("hc_streams",)), (n,),
                          jnp.float32)
        scale = self.param("hc_scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (1,),
                           jnp.float32)
        flat = unit_rms(streams.reshape(streams.shape[:2] + (width,)), c.rms_norm_eps)
        pre = jax.nn.sigmoid(jnp.einsum("bti,oi->bto", flat, fn) * scale[0] + base) + c.hc_eps
        return jnp.einsum("btn,btnd->btd", pre, streams.astype(jnp.float32)).astype(streams.dtype)


def route(scores, chosen, scaling: float):
    """Weights of the chosen experts: their scores renormalised to sum 1, times `scaling`.
    scores [N, E] float32, chosen [N, K] -> [N, K] float32."""
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    return weights / (weights.sum(-1, keepdims=True) + 1e-20) * scaling


class Router(nn.Module):
    """Gate `weight` [E, D]; scores sqrt(softplus(x W^T)) in float32. Hash layers choose experts by
    the token id (`tid2eid` [vocab, K]); the others take the top K of scores plus the selection-only
    `e_score_correction_bias` [E]. (x [N, D], tokens [N]) -> (weights [N, K], experts [N, K])."""

    config: V4Config
    hashed: bool
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, tokens):
        c = self.config
        weight = projection_weight(self, c.n_routed_experts, c.hidden_size, ("router", "embed"), self.dtype,
                                   c.initializer_range, CHECKPOINT)
        logits = linear(x.astype(jnp.float32), weight.astype(jnp.float32))
        scores = jnp.sqrt(jax.nn.softplus(logits))
        if self.hashed:
            table = self.param("tid2eid", nn.with_logical_partitioning(self._hash_init, ("vocab", None)),
                               (c.vocab_size, c.num_experts_per_tok), jnp.int32)
            chosen = table[tokens].astype(jnp.int32)
        else:
            bias = self.param("e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                                      ("router",)),
                              (c.n_routed_experts,), jnp.float32)
            _, chosen = jax.lax.top_k(scores + bias, c.num_experts_per_tok)
        return route(scores, chosen, c.routed_scaling_factor), chosen

    def _hash_init(self, key, shape, dtype):
        """Random distinct experts per token id (checkpoints ship the table)."""
        keys = jax.random.split(key, shape[0])
        pick = jax.vmap(lambda k: jax.random.permutation(k, self.config.n_routed_experts)[:shape[1]])
        return pick(keys).astype(dtype)


class MoE(nn.Module):
    """Routed experts (hash or top-k routed, clamped SwiGLU) plus the shared experts.
    (x [B, T, D], tokens [B, T]) -> [B, T, D]."""

    config: V4Config
    hashed: bool
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        self.gate = Router(c, self.hashed, self.dtype)
        self.experts = Experts(c, self.dtype, swiglu_limit=c.swiglu_limit)
        if c.n_shared_experts:
            self.shared_experts = MLP(c, c.moe_intermediate_size * c.n_shared_experts, self.dtype,
                                      swiglu_limit=c.swiglu_limit)

    def __call__(self, x, tokens):
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat, tokens.reshape(-1))
        out = self.experts(flat, weights, experts).reshape(x.shape)
        if self.config.n_shared_experts:
            out = out + self.shared_experts(x)
        return out


def is_hashed(config: V4Config, layer: int) -> bool:
    return config.mlp_layer_types[layer] == HASH_MOE


"""jnp references for FP8 block-scaled matmul (the semantics every kernel must reproduce).

Activations: per token, per 128 channels, amax clamped at 1e-4, scale = amax / 448 (with
DeepSeek-V3.1's "ue8m0" scale format: amax x (1 / 448) rounded up to a power of two), values
x / scale cast to float8_e4m3fn. Weights: stored [N, K] e4m3fn with float32 scales
[ceil(N/128), ceil(K/128)]. C[m, n] = sum over K blocks kb of (A_fp8 . B_fp8 over kb)
x a_scale[m, kb] x b_scale[n // 128, kb], accumulated in float32.
"""

import jax.numpy as jnp
from jax import lax

BLOCK = 128
E4M3_MAX = 448.0


def _pad_last(x, multiple):
    pad = -x.shape[-1] % multiple
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def power_of_two_at_least(t):
    """The smallest power of two >= t, for positive normal float32 t, from its bits: the
    exponent, one more where any mantissa bit is set (DeepSeek-V3.1's "ue8m0" scales)."""
    bits = lax.bitcast_convert_type(t.astype(jnp.float32), jnp.uint32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return lax.bitcast_convert_type(exponent << 23, jnp.float32)


def activation_scales(amax, round_scale: bool = False):
    """Per-tile scales from the tiles' amax [...]: max(amax, 1e-4) / 448; with round_scale
    (quantization_config.scale_fmt "ue8m0"), max(amax, 1e-4) x (1 / 448) rounded up to a power of two."""
    amax = jnp.maximum(amax, 1e-4)
    return power_of_two_at_least(amax * jnp.float32(1 / E4M3_MAX)) if round_scale else amax / E4M3_MAX


def act_quant_reference(x, round_scale: bool = False):
    """x [..., K] -> (x_fp8 [..., K] float8_e4m3fn, scales [..., ceil(K/128)] float32)."""
    k = x.shape[-1]
    blocks = _pad_last(x.astype(jnp.float32), BLOCK).reshape(x.shape[:-1] + (-1, BLOCK))
    scales = activation_scales(jnp.max(jnp.abs(blocks), axis=-1), round_scale)
    quantized = (blocks / scales[..., None]).astype(jnp.float8_e4m3fn)
    return quantized.reshape(x.shape[:-1] + (-1,))[..., :k], scales


def fp8_block_matmul_reference(x_fp8, x_scales, w_fp8, w_scales, out_dtype=jnp.float32):
    """x_fp8 [..., K], x_scales [..., ceil(K/128)], w_fp8 [N, K], w_scales [ceil(N/128), ceil(K/128)] -> [..., N]."""
    n = w_fp8.shape[0]
    a = _pad_last(x_fp8.astype(jnp.float32), BLOCK)
    a = a.reshape(a.shape[:-1] + (-1, BLOCK))  # [..., KB, 128]
    b = _pad_last(w_fp8.astype(jnp.float32), BLOCK).reshape(n, -1, BLOCK)  # [N, KB, 128]
    partial = jnp.einsum("...kc,nkc->...nk", a, b)  # one float32 dot product per K block
    b_scale = jnp.repeat(w_scales, BLOCK, axis=0)[:n]  # [N, KB]
    out = jnp.einsum("...nk,...k,nk->...n", partial, x_scales, b_scale)
    return out.astype(out_dtype)

"""jnp references for FP8 block-scaled matmul (the semantics every kernel must reproduce).

Activations: per token, per 128 channels, amax clamped at 1e-4, scale = amax / 448, values
x / scale cast to float8_e4m3fn. Weights: stored [N, K] e4m3fn with float32 scales
[ceil(N/128), ceil(K/128)]. C[m, n] = sum over K blocks kb of (A_fp8 . B_fp8 over kb)
x a_scale[m, kb] x b_scale[n // 128, kb], accumulated in float32.
"""

import jax.numpy as jnp

BLOCK = 128
E4M3_MAX = 448.0


def _pad_last(x, multiple):
    pad = -x.shape[-1] % multiple
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def act_quant_reference(x):
    """x [..., K] -> (x_fp8 [..., K] float8_e4m3fn, scales [..., ceil(K/128)] float32)."""
    k = x.shape[-1]
    blocks = _pad_last(x.astype(jnp.float32), BLOCK).reshape(x.shape[:-1] + (-1, BLOCK))
    scales = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), 1e-4) / E4M3_MAX
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

"""numpy references written from the formulas, in float64: FP8 block quantization and block-scaled
products (docs/fp8_and_kernels.md), the routed experts' weighted sum of SwiGLU outputs, and the
sampling distribution after temperature, top-k and top-p."""

import ml_dtypes
import numpy as np


def numpy_act_quant(x):
    k = x.shape[-1]
    blocks = -(-k // 128)
    padded = np.zeros(x.shape[:-1] + (blocks * 128,), np.float32)
    padded[..., :k] = x
    g = padded.reshape(x.shape[:-1] + (blocks, 128))
    s = np.maximum(np.abs(g).max(-1), 1e-4) / 448.0
    q = (g / s[..., None]).astype(ml_dtypes.float8_e4m3fn).reshape(padded.shape)[..., :k]
    return q, s.astype(np.float32)


def numpy_block_matmul(xq, xs, wq, ws):
    """C[m, n] = sum_k A[m, k] a_s[m, k // 128] B[n, k] b_s[n // 128, k // 128], in float64."""
    k = np.arange(xq.shape[-1])
    a = xq.astype(np.float64) * xs[..., k // 128]
    n = np.arange(wq.shape[0])
    b = wq.astype(np.float64) * ws[n // 128][:, k // 128]
    return a @ b.T


def bits(a):
    return np.asarray(a).view(np.uint8)


def assert_quantized_like_numpy(x, xq, xs):
    """XLA computes a / broadcast(b) as a * broadcast(1 / b), so on CPU the scales (in the kernel
    and in act_quant_reference alike) may be 1 ulp off numpy's amax / 448 and a quotient may then
    round the other way when it lies within ~2^-22 (relative) of an e4m3 rounding midpoint. So:
    scales within 1 ulp, and each value one of the roundings of x / scale (float64) widened by
    2^-20 -- which is numpy's own rounding everywhere but at such near-ties."""
    _, want_s = numpy_act_quant(x)
    np.testing.assert_array_max_ulp(np.asarray(xs), want_s, maxulp=1)
    exact = x / np.repeat(want_s.astype(np.float64), 128, axis=-1)[..., : x.shape[-1]]
    low, high = (bits((exact * (1 + d)).astype(ml_dtypes.float8_e4m3fn)) for d in (-(2.0**-20), 2.0**-20))
    assert np.all((bits(xq) == low) | (bits(xq) == high))


def reference_experts(x, weights, experts, gate, up, down):
    """Per token: sum over its chosen experts e of w * down_e(silu(gate_e x) * up_e x), float64."""
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            g = gate[e] @ x[t]
            out[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * (up[e] @ x[t])))
    return out


def sampling_distribution(logits, temperature, top_k, top_p):
    """One row's logits [V] -> its sampling distribution [V], by sorting: divided by the temperature
    (in float32, as jaxmtp divides), the logits below the top_k-th largest dropped (top_k 0: none),
    then the tokens kept in descending order while the mass ranked above each is below top_p, and
    every token as probable as the last kept (ties at either edge stay)."""
    z = (np.asarray(logits, np.float32) / np.float32(temperature)).astype(np.float64)
    if top_k:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        ranked = np.sort(p)[::-1]
        before = np.cumsum(ranked) - ranked  # the mass of the tokens ranked above each
        p = np.where(p >= ranked[before < top_p].min(), p, 0.0)
        p /= p.sum()
    return p

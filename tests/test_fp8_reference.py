"""The FP8 jnp references against float64 numpy written from the spec's section 4 formulas."""

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import act_quant_reference, fp8_block_matmul_reference


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


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), n=st.sampled_from([1, 64, 128, 200, 576]), k=st.sampled_from([128, 256, 320, 7]),
       batch=st.sampled_from([(), (2,)]), seed=st.integers(0, 1000))
def test_block_matmul_reference_matches_numpy(m, n, k, batch, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=3.0, size=batch + (m, k)).astype(np.float32)
    xq, xs = act_quant_reference(x)
    ref_q, ref_s = numpy_act_quant(x)
    assert_quantized_like_numpy(x, xq, xs)
    wq = rng.normal(size=(n, k)).astype(ml_dtypes.float8_e4m3fn)
    ws = rng.uniform(0.01, 0.1, size=(-(-n // 128), -(-k // 128))).astype(np.float32)
    got = np.asarray(fp8_block_matmul_reference(xq, xs, wq, ws))
    want = numpy_block_matmul(ref_q, ref_s, wq, ws)
    assert got.shape == batch + (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

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


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), n=st.sampled_from([1, 64, 128, 200, 576]), k=st.sampled_from([128, 256, 320, 7]),
       batch=st.sampled_from([(), (2,)]), seed=st.integers(0, 1000))
def test_block_matmul_reference_matches_numpy(m, n, k, batch, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=3.0, size=batch + (m, k)).astype(np.float32)
    xq, xs = act_quant_reference(x)
    ref_q, ref_s = numpy_act_quant(x)
    np.testing.assert_array_equal(np.asarray(xq).astype(np.float32), ref_q.astype(np.float32))
    np.testing.assert_allclose(np.asarray(xs), ref_s, rtol=1e-6)
    wq = rng.normal(size=(n, k)).astype(ml_dtypes.float8_e4m3fn)
    ws = rng.uniform(0.01, 0.1, size=(-(-n // 128), -(-k // 128))).astype(np.float32)
    got = np.asarray(fp8_block_matmul_reference(xq, xs, wq, ws))
    want = numpy_block_matmul(ref_q, ref_s, wq, ws)
    assert got.shape == batch + (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

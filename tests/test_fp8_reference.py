"""The FP8 jnp references against float64 numpy written from the block-scaled FP8 formulas
(docs/fp8_and_kernels.md)."""

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numpy_reference import assert_quantized_like_numpy, numpy_act_quant, numpy_block_matmul
from pallas_kernels import act_quant_reference, fp8_block_matmul_reference


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

"""The FP8 Pallas kernels against float64 numpy written from the block-scaled FP8 formulas (docs/fp8_and_kernels.md), in
both kernel layouts and with and without native FP8 (interpret mode; on a GPU or TPU the random
tests run the compiled kernels); and their lowering for TPU (Mosaic) and GPU (Triton) without the
hardware."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy_reference import assert_quantized_like_numpy, bits, numpy_act_quant, numpy_block_matmul

from pallas_kernels import (Backend, act_quant, act_quant_reference, backend, fp8_block_matmul,
                            fp8_grouped_matmul)

E4M3 = ml_dtypes.float8_e4m3fn
# Every kernel variant, run in interpret mode: "grid" is the TPU layout, "loop" the GPU one;
# native_fp8=False is the integer encode/decode path of hardware without FP8 matmul.
TARGETS = [Backend("cpu", True, native, layout) for layout in ("grid", "loop") for native in (True, False)]
# On a GPU or TPU the random tests run the compiled kernels instead, with and without native FP8
# (interpret mode is for CPUs: executed by XLA:GPU under jax 0.11.2, the grid layout gave NaN for
# 32-row tiles).
HERE = backend()
target_st = st.sampled_from(TARGETS if HERE.interpret else [HERE, dataclasses.replace(HERE, native_fp8=False)])


def _random_weight(rng, shape):
    """e4m3fn values [*lead, N, K] and block scales [*lead, ceil(N/128), ceil(K/128)]."""
    *lead, n, k = shape
    w = rng.normal(size=shape).astype(E4M3)
    ws = rng.uniform(0.01, 0.1, size=(*lead, -(-n // 128), -(-k // 128))).astype(np.float32)
    return w, ws


def _activations(rng, shape):
    """Normal values with rows scaled by 0, 1e-6 (amax below the 1e-4 clamp), 1 or 1e3."""
    row_scale = rng.choice([0.0, 1e-6, 1.0, 1e3], size=shape[:-1] + (1,))
    return (rng.normal(scale=3.0, size=shape) * row_scale).astype(np.float32)


def _assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_backend_follows_the_platform():
    platform = jax.devices()[0].platform
    assert HERE.interpret == (platform == "cpu")
    assert HERE.layout == ("loop" if platform == "gpu" else "grid")


@settings(max_examples=16, deadline=None)
@given(m=st.integers(1, 70) | st.integers(129, 300), n=st.sampled_from([1, 64, 128, 200, 576]),
       k=st.sampled_from([7, 128, 320]), batch=st.sampled_from([(), (2,)]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), target=target_st, seed=st.integers(0, 1000))
def test_act_quant_and_block_matmul_match_numpy(m, n, k, batch, dtype, target, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(_activations(rng, batch + (m, k)), dtype)
    xq, xs = act_quant(x, target=target)
    assert xq.dtype == jnp.float8_e4m3fn and xs.dtype == jnp.float32
    if target.interpret:  # XLA's arithmetic, as in the reference; compiled kernels divide as IEEE does
        # XLA may round amax / 448 as a quotient in one program and as amax * (1 / 448) in the
        # other (m=1, k=7, bfloat16, seed 8: 1 ulp apart), so: scales within 1 ulp, and the same
        # values wherever the scales are the same.
        ref_q, ref_s = act_quant_reference(x)
        np.testing.assert_array_max_ulp(np.asarray(xs), np.asarray(ref_s), maxulp=1)
        same = np.repeat(np.asarray(xs) == np.asarray(ref_s), 128, axis=-1)[..., :k]
        np.testing.assert_array_equal(bits(xq)[same], bits(ref_q)[same])
    assert_quantized_like_numpy(np.asarray(x, np.float32), xq, xs)
    w, ws = _random_weight(rng, (n, k))
    got = fp8_block_matmul(xq, xs, w, ws, jnp.float32, target=target)
    assert got.shape == batch + (m, n) and got.dtype == jnp.float32
    _assert_close(np.asarray(got), numpy_block_matmul(np.asarray(xq), np.asarray(xs), w, ws))


@pytest.mark.parametrize("target", TARGETS[::3], ids=["grid-fp8", "loop-bytes"])
def test_bf16_output_is_the_rounded_float32_result(target):
    rng = np.random.default_rng(0)
    xq, xs = numpy_act_quant(rng.normal(size=(3, 40, 320)).astype(np.float32))
    w, ws = _random_weight(rng, (200, 320))
    got = np.asarray(fp8_block_matmul(xq, xs, w, ws, target=target)).astype(np.float32)
    want = numpy_block_matmul(xq, xs, w, ws)
    # bf16 rounding is within 2^-9 relative; the float32 accumulation adds far less
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-5 * np.abs(want).max())


def _rounding_cases():
    """Every finite e4m3 magnitude, every midpoint between neighbours and the float32 values
    just beside each midpoint, with both signs; all within +-448."""
    values = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    grid = np.unique(np.abs(values[np.isfinite(values)]))
    mid = (grid[1:] + grid[:-1]) / 2
    near = [np.nextafter(mid, 0.0).astype(np.float32), np.nextafter(mid, 1e3).astype(np.float32)]
    cases = np.concatenate([grid, mid, *near])
    return np.concatenate([cases, -cases])


@pytest.mark.parametrize("target", TARGETS[:2], ids=["fp8", "bytes"])
def test_act_quant_rounds_every_case_like_numpy(target):
    """Rows led by 448 have scale exactly 1, so the quantized values are the inputs rounded."""
    cases = _rounding_cases()
    rows = np.resize(cases, (-(-cases.size // 127), 127))
    x = np.concatenate([np.full((rows.shape[0], 1), 448.0, np.float32), rows], axis=1)
    xq, xs = act_quant(x, target=target)
    np.testing.assert_array_equal(np.asarray(xs), 1.0)
    np.testing.assert_array_equal(bits(xq), bits(x.astype(E4M3)))


@pytest.mark.parametrize("target", TARGETS[1::2], ids=["grid-bytes", "loop-bytes"])
def test_block_matmul_decodes_every_fp8_value(target):
    """x = identity (scales 1) makes C[m, n] = w[n, m]: each finite e4m3 code read back exactly."""
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)] + [0, 0], np.uint8)
    w = codes.reshape(2, 128).view(E4M3)
    x = np.eye(128, dtype=np.float32).astype(E4M3)
    got = fp8_block_matmul(x, np.ones((128, 1), np.float32), w, np.ones((1, 1), np.float32),
                           jnp.float32, target=target)
    np.testing.assert_array_equal(np.asarray(got), w.astype(np.float32).T)


def numpy_grouped_matmul(xq, xs, wq, ws, group_sizes):
    """Rows of group g use weight g; rows after sum(group_sizes) are zero; float64."""
    out = np.zeros((xq.shape[0], wq.shape[1]))
    start = 0
    for g, size in enumerate(group_sizes):
        rows = slice(start, start + size)
        out[rows] = numpy_block_matmul(xq[rows], xs[rows], wq[g], ws[g])
        start += size
    return out


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(0, 80), min_size=1, max_size=4), extra=st.integers(0, 40),
       n=st.sampled_from([64, 200]), k=st.sampled_from([7, 320]), target=target_st,
       seed=st.integers(0, 1000))
def test_grouped_matmul_matches_numpy(sizes, extra, n, k, target, seed):
    rng = np.random.default_rng(seed)
    m = max(sum(sizes) + extra, 1)
    xq, xs = numpy_act_quant(_activations(rng, (m, k)))
    w, ws = _random_weight(rng, (len(sizes), n, k))
    got = fp8_grouped_matmul(xq, xs, w, ws, jnp.array(sizes, jnp.int32), jnp.float32, target=target)
    assert got.shape == (m, n)
    _assert_close(np.asarray(got), numpy_grouped_matmul(xq, xs, w, ws, sizes))


def _lower(fn, target, platform, *shapes):
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.jit(lambda *a: fn(*a, target=target)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("native", [True, False], ids=["fp8", "bytes"])
@pytest.mark.parametrize("kind, platform, layout, custom_call", [
    ("tpu", "tpu", "grid", "tpu_custom_call"),
    ("gpu", "cuda", "loop", "__gpu$xla.gpu.triton"),
])
def test_kernels_lower_for_tpu_and_gpu(kind, platform, layout, custom_call, native):
    """Mosaic (TPU) and Triton (GPU) lowering needs no hardware; this proves the kernels pass it."""
    target = Backend(kind, False, native, layout)
    fp8, f32 = jnp.float8_e4m3fn, jnp.float32
    texts = [
        _lower(act_quant, target, platform, ((40, 320), jnp.bfloat16)),
        _lower(fp8_block_matmul, target, platform, ((2, 40, 320), fp8), ((2, 40, 3), f32), ((576, 320), fp8),
               ((5, 3), f32)),
        _lower(fp8_grouped_matmul, target, platform, ((40, 320), fp8), ((40, 3), f32), ((3, 576, 320), fp8),
               ((3, 5, 3), f32), ((3,), jnp.int32)),
    ]
    for text in texts:
        assert f"custom_call @{custom_call}(" in text

"""Pallas kernels for DeepSeek-V3's W8A8 FP8 scheme: 1x128 activation quantization, the 128x128
block-scaled GEMM and its grouped (MoE expert) variant. Semantics: `pallas_kernels.reference`.

Two kernel layouts share the per-K-block arithmetic (`_scaled_block`):
- "grid" (Mosaic TPU; CPU in interpret mode): the K blocks are the innermost grid axis and a
  float32 VMEM scratch accumulates across them; the grouped GEMM walks a scalar-prefetched
  schedule of (row tile, expert) visits.
- "loop" (Triton on GPU, which has neither scratch buffers nor scalar prefetch, and whose grid
  programs run concurrently so an output block cannot be revisited): grid over (M, N) tiles,
  the K blocks (and the experts of a row tile) are loops inside the kernel.
Mosaic GPU (JAX's default Pallas GPU backend) is not used: `pallas_call` is deprecated there in
favour of `plgpu.kernel`, and it rejects these kernels at lowering with "ValueError: Async
copies only support copying <=256 elements along each dimension" (the K-long blocks),
"NotImplementedError: No support for axes yet" (the per-row amax) and "NotImplementedError:
Unsupported memory space: vmem" (the grid layout's scratch); it needs warpgroup kernels of its own.

Both lower without the hardware (`jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))`
gives a `tpu_custom_call`, `("cuda",)` a `__gpu$xla.gpu.triton` call; the tests check this). On a
GPU, benchmarks/fp8_gemm.py compiles the Triton kernels and checks them against the references;
the Mosaic TPU ones are checked at lowering only.

Where the hardware has no FP8 matmul (TPU before v7, GPU before sm89) the kernels never touch an
FP8 type: FP8 arrays cross the kernel boundary as raw bytes (uint8, a free bitcast) and are
encoded/decoded with integer arithmetic (Triton cannot even cast e4m3fn below sm89). Decoded
e4m3 values are exact in bf16, so the fallback dot is bf16 x bf16 with float32 accumulation.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.reference import BLOCK, activation_scales

FP8 = jnp.float8_e4m3fn
_NT = (((1,), (1,)), ((), ()))  # contract the last dims of both: A [m, k] . B [n, k]^T


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the kernels run. platform: "cpu" | "gpu" | "tpu"; layout: "grid" | "loop"."""

    platform: str
    interpret: bool
    native_fp8: bool
    layout: str


def backend(interpret=None):
    """The Backend for the default device. interpret=None: interpret on CPU, compile elsewhere."""
    device = jax.devices()[0]
    interpret = device.platform == "cpu" if interpret is None else interpret
    if device.platform == "gpu":
        return Backend("gpu", interpret, _gpu_has_fp8_matmul(device), "loop")
    if device.platform == "tpu":
        return Backend("tpu", interpret, _tpu_has_fp8_matmul(), "grid")
    return Backend(device.platform, interpret, True, "grid")  # XLA:CPU runs FP8 in interpret mode


def _gpu_has_fp8_matmul(device):
    capability = str(getattr(device, "compute_capability", ""))  # "9.0" on CUDA, "gfx..." on ROCm
    major, _, minor = capability.partition(".")
    return major.isdigit() and minor.isdigit() and (int(major), int(minor)) >= (8, 9)


def _tpu_has_fp8_matmul():
    try:
        return pltpu.get_tpu_info().is_matmul_supported(FP8, FP8)
    except ValueError:  # a chip this JAX version does not know
        return False


def _compiler_params(target, semantics):
    if target.interpret:
        return None
    if target.platform == "tpu":
        return pltpu.CompilerParams(dimension_semantics=semantics)
    # 8 warps: more TFLOPS than 4 at M >= 128 on the shapes of benchmarks/fp8_gemm.py
    return pltriton.CompilerParams(num_warps=8, num_stages=3)


# --- e4m3fn <-> raw bytes with integer arithmetic (for hardware without FP8 support) ---


def _e4m3_bits_to_bf16(bits):
    """uint8 e4m3fn bit patterns -> bf16 values (exact; the NaN pattern is not special-cased)."""
    u = bits.astype(jnp.int32)
    exponent, mantissa = (u >> 3) & 0xF, u & 7
    significand = jnp.where(exponent > 0, mantissa + 8, mantissa)  # implicit 1 of normals
    # 2^(max(e, 1) - 7 - 3) built from its float32 bits: exact, unlike exp2 on some hardware
    power = lax.bitcast_convert_type((jnp.maximum(exponent, 1) + 117) << 23, jnp.float32)
    magnitude = significand.astype(jnp.float32) * power
    return jnp.where(u >= 128, -magnitude, magnitude).astype(jnp.bfloat16)


def _f32_to_e4m3_bits(y):
    """float32 [..] with |y| <= 448 -> uint8 e4m3fn bit patterns, rounded to nearest even."""
    u = lax.bitcast_convert_type(y, jnp.int32)
    magnitude = u & 0x7FFFFFFF
    # normals: keep 3 mantissa bits (round half to even on the 20 dropped bits), rebias 127 -> 7
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    code = jnp.where(magnitude < (121 << 23), _subnormal_code(magnitude), normal)  # 2^-6: 121 << 23
    return (code | jnp.where(u < 0, 128, 0)).astype(jnp.uint8)


def _subnormal_code(magnitude):
    """float32 bits of |y| < 2^-6 -> round(|y| * 2^9), half to even, in integers (Triton has no
    `round`, and a float rounding trick would round twice). A round-up to 8 lands on the code of
    the smallest normal, 2^-6, as it should."""
    exponent = magnitude >> 23
    significand = (magnitude & 0x7FFFFF) | jnp.where(exponent > 0, 1 << 23, 0)
    shift = jnp.clip(141 - jnp.maximum(exponent, 1), 1, 31)  # |y| * 2^9 = significand >> shift
    odd = (significand >> shift) & 1
    return (significand + (1 << (shift - 1)) - 1 + odd) >> shift


def _to_bytes(x, target):
    return x if target.native_fp8 else lax.bitcast_convert_type(x, jnp.uint8)


def _from_bytes(x):
    return x if x.dtype == FP8 else lax.bitcast_convert_type(x, FP8)


# --- shapes ---


def _round_up(x, multiple):
    return -(-x // multiple) * multiple


def _block_m(m):
    """Row tile: a power of two (Triton) in [32, 128] (32 rows = one native 8-bit TPU tile)."""
    return min(128, max(32, 1 << (m - 1).bit_length()))


def _pad_to(x, shape):
    pads = [(0, t - s) for s, t in zip(x.shape, shape)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _scales_by_block(x_scales, m_pad):
    """[M, KB] -> [KB, M_pad, 1]: a K block's scales as a column, a legal TPU block shape."""
    return _pad_to(x_scales.T, (x_scales.shape[1], m_pad))[..., None]


# --- activation quantization ---


def _act_quant_kernel(x_ref, q_ref, s_ref, *, round_scale):
    """x_ref [bm, 128] -> q_ref [bm, 128] (e4m3fn or its bytes), s_ref [bm, 1] float32."""
    x = x_ref[...].astype(jnp.float32)
    scale = activation_scales(jnp.max(jnp.abs(x), axis=1, keepdims=True), round_scale)
    y = x / scale
    q_ref[...] = y.astype(q_ref.dtype) if q_ref.dtype == FP8 else _f32_to_e4m3_bits(y)
    s_ref[...] = scale


@functools.partial(jax.jit, static_argnames=("target", "round_scale"))
def _act_quant(x, target, round_scale):
    m, k = x.shape
    bm = _block_m(m)
    m_pad, k_pad = _round_up(m, bm), _round_up(k, BLOCK)
    kb = k_pad // BLOCK
    q, s = pl.pallas_call(
        functools.partial(_act_quant_kernel, round_scale=round_scale),
        out_shape=(
            jax.ShapeDtypeStruct((m_pad, k_pad), FP8 if target.native_fp8 else jnp.uint8),
            jax.ShapeDtypeStruct((kb, m_pad, 1), jnp.float32),
        ),
        grid=(m_pad // bm, kb),
        in_specs=[pl.BlockSpec((bm, BLOCK), lambda i, j: (i, j))],
        out_specs=(
            pl.BlockSpec((bm, BLOCK), lambda i, j: (i, j)),
            pl.BlockSpec((None, bm, 1), lambda i, j: (j, i, 0)),
        ),
        interpret=target.interpret,
        compiler_params=_compiler_params(target, ("parallel", "parallel")),
    )(_pad_to(x, (m_pad, k_pad)))  # zero padding cannot raise a tile's amax
    return _from_bytes(q[:m, :k]), s[:, :m, 0].T


def act_quant(x, *, round_scale: bool = False, interpret=None, target=None):
    """Per token per 128 channels: scale = max(amax, 1e-4) / 448, values x / scale in e4m3fn.

    Args:
      x: [..., K] any float dtype.
      round_scale: DeepSeek-V3.1's "ue8m0" scale format: each scale max(amax, 1e-4) x (1 / 448)
        rounded up to a power of two (see `reference.activation_scales`).
      interpret: None chooses by platform (see `backend`); True forces interpret mode.
      target: a `Backend` overriding the detection (e.g. to force the integer FP8 fallback).
    Returns:
      (x_fp8 [..., K] float8_e4m3fn, scales [..., ceil(K/128)] float32) for finite x. Both
      divisions are the backend's: XLA (interpret mode, like `act_quant_reference`) may compute
      a / b as a * (1 / b), so a scale can be 1 ulp from the IEEE amax / 448 that Triton's
      division (and DeepSeek's kernel) gives, and from the reference's where XLA rounds the two
      programs differently.
    """
    target = target or backend(interpret)
    q, s = _act_quant(x.reshape(-1, x.shape[-1]), target, round_scale)
    return q.reshape(x.shape), s.reshape(x.shape[:-1] + (-1,))


# --- one K block: the FP8 dot, exact in float32, then both scales ("promotion") ---


def _scaled_block(a, b, a_scale, b_scale):
    """a [bm, 128], b [bn, 128] (e4m3fn or bytes), a_scale [bm, 1], b_scale [1, 1] -> [bm, bn] f32."""
    if a.dtype != FP8:
        a, b = _e4m3_bits_to_bf16(a), _e4m3_bits_to_bf16(b)
    partial = lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)
    return partial * a_scale * b_scale


# --- dense block-scaled GEMM ---


def _matmul_grid_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, acc_ref):
    """Grid (M tiles, N tiles, K blocks); acc_ref [bm, bn] float32 lives across the K axis."""
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += _scaled_block(x_ref[...], w_ref[...], xs_ref[...], ws_ref[...])

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _matmul_loop_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref):
    """Grid (M tiles, N tiles); x_ref [bm, K_pad], w_ref [bn, K_pad]: K blocks are a loop."""

    def body(k, acc):
        cols = pl.ds(pl.multiple_of(k * BLOCK, BLOCK), BLOCK)
        return acc + _scaled_block(x_ref[:, cols], w_ref[:, cols], xs_ref[k], ws_ref[k])

    acc = lax.fori_loop(0, xs_ref.shape[0], body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _matmul_specs(layout, bm, kb):
    """BlockSpecs for (x, x_scales [KB, M, 1], w, w_scales [NB, KB, 1, 1]) and the output."""
    if layout == "grid":
        ins = [
            pl.BlockSpec((bm, BLOCK), lambda i, j, k: (i, k)),
            pl.BlockSpec((None, bm, 1), lambda i, j, k: (k, i, 0)),
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j, k: (j, k)),
            pl.BlockSpec((None, None, 1, 1), lambda i, j, k: (j, k, 0, 0)),
        ]
        return ins, pl.BlockSpec((bm, BLOCK), lambda i, j, k: (i, j))
    ins = [
        pl.BlockSpec((bm, kb * BLOCK), lambda i, j: (i, 0)),
        pl.BlockSpec((kb, bm, 1), lambda i, j: (0, i, 0)),
        pl.BlockSpec((BLOCK, kb * BLOCK), lambda i, j: (j, 0)),
        pl.BlockSpec((None, kb, 1, 1), lambda i, j: (j, 0, 0, 0)),
    ]
    return ins, pl.BlockSpec((bm, BLOCK), lambda i, j: (i, j))


@functools.partial(jax.jit, static_argnames=("out_dtype", "target"))
def _block_matmul(x, x_scales, w, w_scales, out_dtype, target):
    (m, k), n = x.shape, w.shape[0]
    bm = _block_m(m)
    m_pad, n_pad, k_pad = _round_up(m, bm), _round_up(n, BLOCK), _round_up(k, BLOCK)
    kb = k_pad // BLOCK
    grid = (m_pad // bm, n_pad // BLOCK) + ((kb,) if target.layout == "grid" else ())
    in_specs, out_spec = _matmul_specs(target.layout, bm, kb)
    out = pl.pallas_call(
        _matmul_grid_kernel if target.layout == "grid" else _matmul_loop_kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM((bm, BLOCK), jnp.float32)] if target.layout == "grid" else [],
        interpret=target.interpret,
        compiler_params=_compiler_params(target, ("parallel", "parallel", "arbitrary")),
    )(
        _to_bytes(_pad_to(x, (m_pad, k_pad)), target),
        _scales_by_block(x_scales, m_pad),
        _to_bytes(_pad_to(w, (n_pad, k_pad)), target),
        w_scales[..., None, None],
    )
    return out[:m, :n]


def fp8_block_matmul(x_fp8, x_scales, w_fp8, w_scales, out_dtype=jnp.bfloat16, *, interpret=None,
                     target=None):
    """C[m, n] = sum_kb (A_fp8 . B_fp8 over K block kb) * a_s[m, kb] * b_s[n // 128, kb].

    Tiles: bm in [32, 128], bn = bk = 128 (one weight scale per tile and K block). Inputs are
    zero-padded to whole tiles here; an unaligned weight (N or K not a multiple of 128) is thus
    copied on every call, so pre-pad such weights (zero values) once if that matters.

    Args:
      x_fp8: [..., K] float8_e4m3fn.
      x_scales: [..., ceil(K/128)] float32.
      w_fp8: [N, K] float8_e4m3fn, (out, in) as stored in the checkpoint.
      w_scales: [ceil(N/128), ceil(K/128)] float32.
      out_dtype: bfloat16 or float32; accumulation is float32 either way.
      interpret, target: as in `act_quant`.
    Returns:
      [..., N] out_dtype.
    """
    target = target or backend(interpret)
    lead = x_fp8.shape[:-1]
    out = _block_matmul(x_fp8.reshape(-1, x_fp8.shape[-1]), x_scales.reshape(-1, x_scales.shape[-1]),
                        w_fp8, w_scales, jnp.dtype(out_dtype), target)
    return out.reshape(lead + (w_fp8.shape[0],))


# --- grouped (MoE) GEMM ---


def _group_bounds(group_sizes, m):
    """group_sizes [E] -> (starts, ends) [E] int32, clipped to the m rows."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]]), ends


def _visit_schedule(group_sizes, m_pad, bm):
    """The (row tile, group) pairs that intersect, in row order, for the "grid" layout.

    The rows after the last group form a pseudo-group E (no weight) so that every row tile is
    visited and written (with zeros). A tile split between groups is visited once per group.
    Returns int32 arrays [V], V = m_pad / bm + E (a static bound on the count of visits):
    tile, group (clipped to E - 1 for indexing), lo, hi (the group's rows), active (compute or
    not); visits past the real ones repeat the last and are inactive.
    """
    e = group_sizes.shape[0]
    starts, ends = _group_bounds(group_sizes, m_pad)
    starts = jnp.append(starts, ends[-1])
    ends = jnp.append(ends, m_pad)
    counts = jnp.where(ends > starts, (ends - 1) // bm - starts // bm + 1, 0)
    visit_ends = jnp.cumsum(counts)
    v = jnp.arange(m_pad // bm + e)
    real = jnp.minimum(v, visit_ends[-1] - 1)
    group = jnp.searchsorted(visit_ends, real, side="right")
    tile = starts[group] // bm + real - (visit_ends[group] - counts[group])
    active = (v < visit_ends[-1]) & (group < e)
    return tile, jnp.minimum(group, e - 1), starts[group], ends[group], active.astype(jnp.int32)


def _grouped_grid_kernel(tile_ref, group_ref, lo_ref, hi_ref, active_ref,
                         x_ref, xs_ref, w_ref, ws_ref, o_ref, acc_ref):
    """Grid (N tiles, visits, K blocks); consecutive visits of a row tile share acc_ref."""
    v, k = pl.program_id(1), pl.program_id(2)
    first_visit = (v == 0) | (tile_ref[v] != tile_ref[jnp.maximum(v - 1, 0)])

    @pl.when((k == 0) & first_visit)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(active_ref[v] == 1)
    def _():
        rows = tile_ref[v] * acc_ref.shape[0] + lax.broadcasted_iota(jnp.int32, (acc_ref.shape[0], 1), 0)
        mine = (rows >= lo_ref[v]) & (rows < hi_ref[v])
        block = _scaled_block(x_ref[...], w_ref[...], xs_ref[...], ws_ref[...])
        acc_ref[...] += jnp.where(mine, block, 0.0)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _grouped_grid_call(x, xs, w, ws, group_sizes, bm, out_dtype, target):
    """x [M_pad, K_pad], xs [KB, M_pad, 1], w [E, N_pad, K_pad], ws [E, NB, KB, 1, 1]."""
    m_pad, k_pad = x.shape
    e, n_pad, _ = w.shape
    kb = k_pad // BLOCK
    schedule = _visit_schedule(group_sizes, m_pad, bm)

    def k_of(v, k, active):  # inactive visits pin K so the pipeline fetches nothing new
        return jnp.where(active[v] == 1, k, kb - 1)

    def x_map(j, v, k, tile, group, lo, hi, active):
        return tile[v], k_of(v, k, active)

    def xs_map(j, v, k, tile, group, lo, hi, active):
        return k_of(v, k, active), tile[v], 0

    def w_map(j, v, k, tile, group, lo, hi, active):
        return group[v], j, k_of(v, k, active)

    def ws_map(j, v, k, tile, group, lo, hi, active):
        return group[v], j, k_of(v, k, active), 0, 0

    def o_map(j, v, k, tile, group, lo, hi, active):
        return tile[v], j

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(schedule),
        grid=(n_pad // BLOCK, schedule[0].shape[0], kb),
        in_specs=[
            pl.BlockSpec((bm, BLOCK), x_map),
            pl.BlockSpec((None, bm, 1), xs_map),
            pl.BlockSpec((None, BLOCK, BLOCK), w_map),
            pl.BlockSpec((None, None, None, 1, 1), ws_map),
        ],
        out_specs=pl.BlockSpec((bm, BLOCK), o_map),
        scratch_shapes=[pltpu.VMEM((bm, BLOCK), jnp.float32)],
    )
    return pl.pallas_call(
        _grouped_grid_kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid_spec=grid_spec,
        interpret=target.interpret,
        compiler_params=_compiler_params(target, ("parallel", "arbitrary", "arbitrary")),
    )(*schedule, x, xs, w, ws)


def _tile_groups(group_sizes, m_pad, bm):
    """For the "loop" layout: per row tile, the first and last group that may intersect it
    ([Mt] int32 each; first > last when none), and the group starts/ends [E]."""
    starts, ends = _group_bounds(group_sizes, m_pad)
    tile_lo = jnp.arange(m_pad // bm, dtype=jnp.int32) * bm
    first = jnp.searchsorted(ends, tile_lo, side="right").astype(jnp.int32)
    last = jnp.searchsorted(starts, tile_lo + bm, side="left").astype(jnp.int32) - 1
    return first, last, starts, ends


def _grouped_loop_kernel(first_ref, last_ref, starts_ref, ends_ref, x_ref, xs_ref, w_ref, ws_ref,
                         o_ref):
    """Grid (M tiles, N tiles); loops over the tile's groups, then over K blocks.

    x_ref [bm, K_pad], xs_ref [KB, bm, 1]; w_ref [E, N_pad, K_pad] and ws_ref [E, NB, KB, 1, 1]
    are whole because the group is only known inside the kernel.
    """
    i, j = pl.program_id(0), pl.program_id(1)
    bm = x_ref.shape[0]
    rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    n_rows = pl.ds(pl.multiple_of(j * BLOCK, BLOCK), BLOCK)

    def group_body(g, acc):
        def k_body(k, part):
            cols = pl.ds(pl.multiple_of(k * BLOCK, BLOCK), BLOCK)
            return part + _scaled_block(x_ref[:, cols], w_ref[g, n_rows, cols], xs_ref[k], ws_ref[g, j, k])

        part = lax.fori_loop(0, xs_ref.shape[0], k_body, jnp.zeros_like(acc))
        mine = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        return acc + jnp.where(mine, part, 0.0)

    acc = lax.fori_loop(first_ref[i], last_ref[i] + 1, group_body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_loop_call(x, xs, w, ws, group_sizes, bm, out_dtype, target):
    """Shapes as in `_grouped_grid_call`."""
    m_pad, k_pad = x.shape
    e, n_pad, _ = w.shape
    kb = k_pad // BLOCK
    metadata = _tile_groups(group_sizes, m_pad, bm)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    return pl.pallas_call(
        _grouped_loop_kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), out_dtype),
        grid=(m_pad // bm, n_pad // BLOCK),
        in_specs=[whole(a) for a in metadata] + [
            pl.BlockSpec((bm, k_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((kb, bm, 1), lambda i, j: (0, i, 0)),
            whole(w),
            whole(ws),
        ],
        out_specs=pl.BlockSpec((bm, BLOCK), lambda i, j: (i, j)),
        interpret=target.interpret,
        compiler_params=_compiler_params(target, None),
    )(*metadata, x, xs, w, ws)


@functools.partial(jax.jit, static_argnames=("out_dtype", "target"))
def _grouped_matmul(x, x_scales, w, w_scales, group_sizes, out_dtype, target):
    (m, k), (e, n, _) = x.shape, w.shape
    bm = _block_m(m)
    m_pad, n_pad, k_pad = _round_up(m, bm), _round_up(n, BLOCK), _round_up(k, BLOCK)
    call = _grouped_grid_call if target.layout == "grid" else _grouped_loop_call
    out = call(
        _to_bytes(_pad_to(x, (m_pad, k_pad)), target),
        _scales_by_block(x_scales, m_pad),
        _to_bytes(_pad_to(w, (e, n_pad, k_pad)), target),
        w_scales[..., None, None],
        group_sizes,
        bm,
        out_dtype,
        target,
    )
    return out[:m, :n]


def fp8_grouped_matmul(x_fp8, x_scales, w_fp8, w_scales, group_sizes, out_dtype=jnp.bfloat16, *,
                       interpret=None, target=None):
    """Row r of group g (rows sorted by group): C[r] = fp8_block_matmul(x[r], w[g]); rows past
    sum(group_sizes) are zero.

    Cost: a row tile that straddles groups is multiplied once per group it touches (rows of the
    other groups masked), so the work is about (M / bm + E) row tiles instead of M / bm. On TPU
    a scalar-prefetched schedule of (tile, group) visits drives the grid and skipped visits
    fetch nothing; its grid is N/128 x (M/bm + E) x K/128 steps. On GPU each program loops over
    its tile's groups, and empty groups between two nonempty ones in a tile cost a masked pass.

    Args:
      x_fp8: [M, K] float8_e4m3fn, rows sorted by group.
      x_scales: [M, ceil(K/128)] float32.
      w_fp8: [E, N, K] float8_e4m3fn.
      w_scales: [E, ceil(N/128), ceil(K/128)] float32.
      group_sizes: [E] int32, sum <= M.
      out_dtype, interpret, target: as in `fp8_block_matmul`.
    Returns:
      [M, N] out_dtype.
    """
    target = target or backend(interpret)
    return _grouped_matmul(x_fp8, x_scales, w_fp8, w_scales, group_sizes, jnp.dtype(out_dtype), target)

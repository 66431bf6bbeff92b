"""FP8 block-scaled weights as DeepSeek-V3 publishes them.

A `QuantizedWeight` holds float8_e4m3fn values [..., out, in] and float32 block scales
[..., ceil(out/b), ceil(in/b)] (b = 128); the real weight is value * scale of its block (the
checkpoint calls the scale `weight_scale_inv`, but it multiplies). It is a pytree, so it sits in
the parameter tree in place of a dense array, stacks over layers and slices under `nn.scan`.

How it is multiplied is static, part of the weight (`matmul`): "dequant" expands it to a dense
weight inside the jitted computation; "fp8" quantizes the activations per token and 128 channels
(with power-of-two scales where the checkpoint's `scale_fmt` is "ue8m0", as DeepSeek-V3.1's are)
and runs DeepSeek-V3's W8A8 block-scaled GEMM (`pallas_kernels`). Weight scales are used as stored.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.errors import InputError
from pallas_kernels import act_quant, backend, fp8_block_matmul, fp8_grouped_matmul

# Parameters stored in FP8 by the published checkpoints: every attention and FFN projection, and
# DeepSeek-V3.2's indexer query and key projections. Embeddings, the head, norms, the router,
# eh_proj and the indexer's head weights (weights_proj) stay in high precision.
QUANTIZED_MODULES = frozenset({"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                               "gate_proj", "up_proj", "down_proj", "wq_b", "wk"})


def is_quantized_param(path: tuple[str, ...]) -> bool:
    """Whether the parameter at this path is FP8 in a quantized checkpoint."""
    module = path[-1] if "experts" in path else path[-2]
    return path[-1] in ("weight", "gate_proj", "up_proj", "down_proj") and module in QUANTIZED_MODULES


@flax.struct.dataclass
class QuantizedWeight:
    """An FP8 block-scaled weight: its values, block scales and how it is multiplied (static)."""

    value: jax.Array  # [..., out, in] float8_e4m3fn
    scale: jax.Array  # [..., ceil(out/b), ceil(in/b)] float32
    block: tuple[int, int] = flax.struct.field(pytree_node=False, default=(128, 128))
    matmul: str = flax.struct.field(pytree_node=False, default="dequant")  # "dequant" | "fp8"
    # How "fp8" quantizes the activations' scales: None (amax / 448) or "ue8m0" (rounded up to a
    # power of two, DeepSeek-V3.1's quantization_config.scale_fmt).
    scale_fmt: str | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def rounds_scales(self) -> bool:
        return self.scale_fmt == "ue8m0"

    @property
    def shape(self):
        return self.value.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """value x scale of its block, computed in float32 and cast to dtype."""
        return dequantize(self.value, self.scale, self.block).astype(dtype)


def scale_shape(shape, block=(128, 128)) -> tuple[int, ...]:
    """[..., out, in] -> [..., ceil(out/b0), ceil(in/b1)]."""
    return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def dequantize(value, scale, block=(128, 128), offset=(0, 0)):
    """Expands each block scale over its (possibly partial) tile and multiplies, in float32.

    `value` may be a region of a weight starting `offset` (rows, cols) into the first scale block
    of `scale` (a device's block of a sharded weight); by default it starts on a block boundary."""
    out_dim, in_dim = value.shape[-2:]
    xp = np if isinstance(value, np.ndarray) else jnp
    full = xp.repeat(xp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return value.astype(xp.float32) * full[..., offset[0]:offset[0] + out_dim, offset[1]:offset[1] + in_dim]


MATMULS = ("dequant", "fp8")


def default_matmul() -> str:
    """"fp8" where the FP8 kernels compile for hardware with FP8 matmul (Hopper/Ada GPUs, TPU v7),
    else "dequant" (on CPU the kernels only run in the slow interpret mode)."""
    target = backend()
    return "fp8" if target.platform in ("gpu", "tpu") and target.native_fp8 else "dequant"


QUANTIZED_CHOICES = ("keep", "dequantize")
KERNEL_BLOCK = (128, 128)  # the weight blocks the W8A8 kernels take


def fp8_plan(quantized: str | None = None, matmul: str | None = None, block=KERNEL_BLOCK,
             keep_hint: str = "matmul='fp8' or 'dequant'") -> tuple[str, str | None, str]:
    """How `jaxmtp.load` treats the weights of an FP8 checkpoint with `block`-sized scale blocks:
    (quantized, matmul or None where dequantized at load, reason: a phrase for a progress line).

    quantized None keeps them where a `matmul` is given or the platform multiplies FP8
    (`default_matmul()` is "fp8": one byte per weight, multiplied by the W8A8 kernels, or
    dequantized on the fly where the kernels cannot take the blocks), else dequantizes them at
    load (on a CPU the kernels only run interpreted). keep_hint: how the caller's user asks to
    keep them, named in the reason for a dequantization."""
    if quantized is not None and quantized not in QUANTIZED_CHOICES:
        raise InputError(f"quantized: expected one of {QUANTIZED_CHOICES} or None, found {quantized!r}")
    if matmul is not None and matmul not in MATMULS:
        raise InputError(f"matmul: expected one of {MATMULS}, found {matmul!r}")
    if matmul is not None and quantized == "dequantize":
        raise InputError(f"matmul={matmul!r} applies to FP8 weights kept as such: pass quantized='keep' or None")
    platform = backend().platform
    if quantized == "dequantize":
        return "dequantize", None, "dequantized at load, as asked (quantized='dequantize')"
    if matmul is not None or quantized == "keep":
        how = matmul or default_matmul()
        return "keep", how, f"kept FP8, {_multiplied(how)} ({platform}; matmul={how!r})"
    if default_matmul() != "fp8":
        return "dequantize", None, f"dequantized at load ({platform} has no FP8 matmul; {keep_hint} keeps them FP8)"
    if tuple(block) != KERNEL_BLOCK:
        return "keep", "dequant", (f"kept FP8, {_multiplied('dequant')} (the W8A8 kernels take 128x128 blocks, "
                                   f"this checkpoint has {block[0]}x{block[1]})")
    return "keep", "fp8", f"kept FP8, {_multiplied('fp8')} ({platform} multiplies FP8)"


def _multiplied(matmul: str) -> str:
    return "multiplied by the W8A8 kernels" if matmul == "fp8" else "dequantized on the fly inside each matmul"


def fp8_choice(quantized: str | None = None, matmul: str | None = None, block=KERNEL_BLOCK,
               keep_hint: str = "matmul='fp8' or 'dequant'") -> tuple[str, str]:
    """(quantized, reason) of `fp8_plan`: "keep" or "dequantize", and why in words."""
    quantized, _, reason = fp8_plan(quantized, matmul, block, keep_hint)
    return quantized, reason


def runs_fp8(weight) -> bool:
    """Whether `weight` is multiplied by the FP8 kernels (a QuantizedWeight with matmul="fp8")."""
    return isinstance(weight, QuantizedWeight) and weight.matmul == "fp8"


def is_quantized(params) -> bool:
    """Whether any weight of the parameter tree is kept in FP8 (a QuantizedWeight)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(leaf, QuantizedWeight) for leaf in leaves)


def with_matmul(params, matmul: str, scale_fmt: str | None = None):
    """The parameter tree with every QuantizedWeight set to multiply by `matmul`, quantizing the
    activations with `scale_fmt` (the config's quantization.scale_fmt) where that is "fp8"."""
    if matmul not in MATMULS:
        raise InputError(f"matmul: expected one of {MATMULS}, found {matmul!r}")

    def one(leaf):
        if not isinstance(leaf, QuantizedWeight):
            return leaf
        if matmul == "fp8" and leaf.block != (128, 128):
            raise InputError(f"matmul='fp8' needs 128x128 weight blocks, this checkpoint has {leaf.block}")
        return leaf.replace(matmul=matmul, scale_fmt=scale_fmt)

    return jax.tree.map(one, params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))


def linear(x, weight, inputs_first: bool = False, out_dtype=None) -> jax.Array:
    """x [..., in] times weight [out, in] (dense or QuantizedWeight) transposed, or times a dense
    weight [in, out] stored inputs first -> [..., out] in out_dtype (default x.dtype; accumulated
    in it)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if runs_fp8(weight):
        return fp8_block_matmul(*act_quant(x, round_scale=weight.rounds_scales), weight.value, weight.scale,
                                out_dtype=out_dtype)
    subscripts = "...i,io->...o" if inputs_first else "...i,oi->...o"
    return jnp.einsum(subscripts, x, as_dense(weight, x.dtype), preferred_element_type=out_dtype)


def grouped_linear(x, weight, group_sizes) -> jax.Array:
    """Rows of x, sorted by group, times their group's weight transposed. x [M, I], weight
    [G, O, I] (dense or QuantizedWeight), group_sizes [G] -> [M, O]; rows past the groups are zero."""
    if runs_fp8(weight):
        return fp8_grouped_matmul(*act_quant(x, round_scale=weight.rounds_scales), weight.value, weight.scale,
                                  group_sizes, out_dtype=x.dtype)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(x, as_dense(weight, x.dtype), group_sizes, dims)


def quantize(weight: np.ndarray, block=(128, 128)) -> QuantizedWeight:
    """A dense weight [..., out, in] -> block-scaled e4m3fn as DeepSeek-V3 publishes it: per block
    (partial at the edges) scale = amax / 448, value = weight / scale."""
    weight = np.asarray(weight, np.float32)
    out_dim, in_dim = weight.shape[-2:]
    rows, cols = -(-out_dim // block[0]), -(-in_dim // block[1])
    padded = np.zeros(weight.shape[:-2] + (rows * block[0], cols * block[1]), np.float32)
    padded[..., :out_dim, :in_dim] = weight
    tiles = padded.reshape(weight.shape[:-2] + (rows, block[0], cols, block[1]))
    scale = np.maximum(np.abs(tiles).max(axis=(-3, -1)), 1e-12) / 448.0  # [..., rows, cols]
    value = tiles / scale[..., :, None, :, None]
    value = value.reshape(padded.shape)[..., :out_dim, :in_dim].astype(jnp.float8_e4m3fn)
    return QuantizedWeight(value, scale.astype(np.float32), tuple(block))


def quantize_params(params, block=(128, 128)):
    """Every weight that published FP8 checkpoints store in FP8 (see QUANTIZED_MODULES) quantized
    with `quantize`; everything else unchanged."""
    def one(path, leaf):
        names = tuple(getattr(key, "key", key) for key in path)
        return quantize(np.asarray(leaf), block) if is_quantized_param(names) else leaf

    return jax.tree_util.tree_map_with_path(one, params)


def as_dense(weight, dtype) -> jax.Array:
    """A dense weight in `dtype`, dequantizing on the fly when the parameter is kept in FP8."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(dtype)
    return weight.astype(dtype)

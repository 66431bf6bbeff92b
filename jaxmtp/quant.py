"""FP8 block-scaled weights as DeepSeek-V3 publishes them.

A `QuantizedWeight` holds float8_e4m3fn values [..., out, in] and float32 block scales
[..., ceil(out/b), ceil(in/b)] (b = 128); the real weight is value * scale of its block (the
checkpoint calls the scale `weight_scale_inv`, but it multiplies). It is a pytree, so it sits in
the parameter tree in place of a dense array, stacks over layers and slices under `nn.scan`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Parameters stored in FP8 by the published checkpoints: every attention and FFN projection.
# Embeddings, the head, norms, the router and eh_proj stay in high precision.
QUANTIZED_MODULES = frozenset({"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                               "gate_proj", "up_proj", "down_proj"})


def is_quantized_param(path: tuple[str, ...]) -> bool:
    """Whether the parameter at this path is FP8 in a quantized checkpoint."""
    module = path[-1] if "experts" in path else path[-2]
    return path[-1] in ("weight", "gate_proj", "up_proj", "down_proj") and module in QUANTIZED_MODULES


@flax.struct.dataclass
class QuantizedWeight:
    value: jax.Array  # [..., out, in] float8_e4m3fn
    scale: jax.Array  # [..., ceil(out/b), ceil(in/b)] float32
    block: tuple[int, int] = flax.struct.field(pytree_node=False, default=(128, 128))

    @property
    def shape(self):
        return self.value.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """value x scale of its block, computed in float32 and cast to dtype."""
        return dequantize(self.value, self.scale, self.block).astype(dtype)


def scale_shape(shape, block=(128, 128)) -> tuple[int, ...]:
    """[..., out, in] -> [..., ceil(out/b0), ceil(in/b1)]."""
    return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def dequantize(value, scale, block=(128, 128)):
    """Expands each block scale over its (possibly partial) tile and multiplies, in float32."""
    out_dim, in_dim = value.shape[-2:]
    xp = np if isinstance(value, np.ndarray) else jnp
    full = xp.repeat(xp.repeat(scale, block[0], axis=-2), block[1], axis=-1)[..., :out_dim, :in_dim]
    return value.astype(xp.float32) * full


def as_dense(weight, dtype) -> jax.Array:
    """A dense weight in `dtype`, dequantizing on the fly when the parameter is kept in FP8."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(dtype)
    return weight.astype(dtype)

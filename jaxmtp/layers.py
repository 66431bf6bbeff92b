"""Basic Linen building blocks: RMSNorm, LayerNorm, bias-free Linear, Embed.

Linear stores [out, in] like the checkpoints, or [in, out] in the decode layout. Every parameter is
called `weight` (LayerNorm's shift `bias`) and annotated with logical axis names, so a checkpoint
tensor `...q_a_proj.weight` is the parameter at path `(..., "q_a_proj", "weight")`.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp.layout import CHECKPOINT, Layout
from jaxmtp.quant import linear, runs_fp8
from jaxmtp.sharding import spec

Dtype = Any


def normal_init(stddev: float, axes: tuple[str, ...]):
    """A normal(stddev) initializer whose parameter carries the logical axis names `axes`."""
    return nn.with_logical_partitioning(nn.initializers.normal(stddev), axes)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 then cast back before the gain (as HF does)."""

    features: int
    eps: float
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                            (self.features,), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight * normed.astype(x.dtype)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, in float32 (PyTorch's
    LayerNorm; the lightning indexer's k_norm)."""

    features: int
    eps: float = 1e-6
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                            (self.features,), self.dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
                          (self.features,), self.dtype)
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def projection_weight(module: nn.Module, out_features: int, in_features: int, axes: tuple[str, str], dtype,
                      stddev: float, layout: Layout):
    """The module's "weight" parameter: [out, in] with logical axes `axes`, or [in, out] when
    `layout.inputs_first`."""
    shape = (out_features, in_features)
    if layout.inputs_first:
        shape, axes = shape[::-1], axes[::-1]
    return module.param("weight", normal_init(stddev, axes), shape, dtype)


class Linear(nn.Module):
    """y = x W^T with W stored [out_features, in_features], as in HF and the FP8 checkpoints, or
    y = x W with W stored [in_features, out_features] when `layout.inputs_first` (jaxmtp.layout).

    The stored weight may be a QuantizedWeight, multiplied as its `matmul` says (see jaxmtp.quant).
    On a mesh whose tensor axis splits the weight in whole 128-blocks, the FP8 kernel runs per
    shard in shard_map (XLA cannot partition a kernel: it would gather the whole weight)."""

    in_features: int
    out_features: int
    axes: tuple[str, str]  # logical names of (out, in)
    dtype: Dtype = jnp.float32
    stddev: float = 0.02
    layout: Layout = CHECKPOINT

    def setup(self):
        self.weight = projection_weight(self, self.out_features, self.in_features, self.axes, self.dtype, self.stddev,
                                        self.layout)

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        split = _tensor_split(self.weight, self.axes)
        if split is None:
            return linear(x, self.weight, self.layout.inputs_first, out_dtype)
        return _tensor_parallel_linear(x, self.weight, *split)


def _tensor_split(weight, axes):
    """(mesh, weight spec) when an FP8-kernel weight is split over the context mesh's tensor axis
    in whole 128-blocks of its values, else None."""
    if not runs_fp8(weight):
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("tensor", 1) == 1:
        return None
    weight_spec = spec(axes, weight.shape, mesh)
    split = [dim for dim, axis in enumerate(weight_spec) if axis == "tensor"]
    if not split or (weight.shape[split[0]] // mesh.shape["tensor"]) % weight.block[split[0]]:
        return None
    return mesh, weight_spec


def _tensor_parallel_linear(x, weight, mesh, weight_spec):
    """Column-parallel (out features split: each device writes its slice of y) or row-parallel
    (in features split: each device multiplies its slice of x, one psum adds the parts). Rows of x
    stay split over `data` when it divides them."""
    P = jax.sharding.PartitionSpec
    data = mesh.shape.get("data", 1)
    rows = "data" if data > 1 and x.shape[0] % data == 0 else None
    middle = [None] * (x.ndim - 2)
    column = weight_spec[0] == "tensor"
    x_spec = P(rows, *middle, None if column else "tensor")
    out_spec = P(rows, *middle, "tensor" if column else None)

    def shard(x, value, scale):
        y = linear(x, weight.replace(value=value, scale=scale))
        return y if column else jax.lax.psum(y, "tensor")

    # check_vma off: the Pallas kernels do not declare how their outputs vary over the mesh.
    return jax.shard_map(shard, mesh=mesh, in_specs=(x_spec, weight_spec, weight_spec), out_specs=out_spec,
                         check_vma=False)(x, weight.value, weight.scale)


class Embed(nn.Module):
    """Token embedding [vocab, hidden]; `attend` is the tied output head."""

    vocab_size: int
    features: int
    dtype: Dtype = jnp.float32
    stddev: float = 0.02

    def setup(self):
        self.weight = self.param("weight", normal_init(self.stddev, ("vocab", "embed")),
                                 (self.vocab_size, self.features), self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        weight = self.weight
        if weight.dtype.itemsize == 2 and jnp.issubdtype(weight.dtype, jnp.floating):
            # Rows gathered as 16-bit integers and viewed back: XLA:CPU gathers no bfloat16, and would
            # widen the whole table to float32 (a copy kept across the decode loop) to gather from it.
            rows = jnp.take(jax.lax.bitcast_convert_type(weight, jnp.uint16), tokens, axis=0)
            return jax.lax.bitcast_convert_type(rows, weight.dtype)
        return jnp.take(weight, tokens, axis=0)

    def attend(self, h: jax.Array) -> jax.Array:
        return jnp.einsum("btd,vd->btv", h, self.weight, preferred_element_type=jnp.float32)

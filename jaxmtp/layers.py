"""Basic Linen building blocks: RMSNorm, bias-free Linear in the checkpoint's [out, in] layout, Embed.

Every parameter is called `weight` and annotated with logical axis names, so a checkpoint tensor
`...q_a_proj.weight` is the parameter at path `(..., "q_a_proj", "weight")`.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp.quant import linear

Dtype = Any


def normal_init(stddev: float, axes: tuple[str, ...]):
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


class Linear(nn.Module):
    """y = x W^T with W stored [out_features, in_features], as in HF and the FP8 checkpoints.

    The stored weight may be a QuantizedWeight, multiplied as its `matmul` says (see jaxmtp.quant)."""

    in_features: int
    out_features: int
    axes: tuple[str, str]  # logical names of (out, in)
    dtype: Dtype = jnp.float32
    stddev: float = 0.02

    def setup(self):
        self.weight = self.param("weight", normal_init(self.stddev, self.axes),
                                 (self.out_features, self.in_features), self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.weight)


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
        return jnp.take(self.weight, tokens, axis=0)

    def attend(self, h: jax.Array) -> jax.Array:
        return jnp.einsum("btd,vd->btv", h, self.weight, preferred_element_type=jnp.float32)

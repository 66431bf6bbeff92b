"""The pre-norm decoder layer and the scanned stack of identical layers.

Layers of one kind are stacked on a leading `layers` axis and run with `nn.scan`, so tracing and
compiling cost the same for 4 layers or 61.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp.cache import MLACache
from jaxmtp.config import ModelConfig
from jaxmtp.layers import Dtype, RMSNorm
from jaxmtp.mla import MLA
from jaxmtp.moe import MLP, MoE


class DecoderLayer(nn.Module):
    """Pre-norm block: x + MLA(norm(x)), then + FFN(norm(x)); FFN is MoE or the dense MLP."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    moe: bool = True
    absorbed: bool = False

    @nn.compact
    def __call__(self, x, positions, cache: MLACache | None = None):
        """x [B, T, D], positions [B, T], cache: this layer's MLACache or None -> (x, cache)."""
        c = self.config
        with jax.named_scope("attention"):
            h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="input_layernorm")(x)
            h, cache = MLA(c, self.dtype, self.absorbed, name="self_attn")(h, positions, cache)
            x = x + h
        with jax.named_scope("moe" if self.moe else "mlp"):
            h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x)
            ffn = MoE(c, self.dtype, name="mlp") if self.moe else MLP(c, c.intermediate_size, self.dtype, name="mlp")
            x = x + ffn(h)
        return x, cache


class LayerStack(nn.Module):
    """`num_layers` DecoderLayers with parameters stacked on axis 0, run by nn.scan.

    __call__(x, positions, caches) with caches an MLACache stacked [L, B, S, ...] or None.
    """

    config: ModelConfig
    num_layers: int
    dtype: Dtype = jnp.float32
    moe: bool = True
    absorbed: bool = False

    @nn.compact
    def __call__(self, x, positions, caches: MLACache | None = None):
        scanned = nn.scan(DecoderLayer, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                          in_axes=(nn.broadcast, 0), length=self.num_layers,
                          metadata_params={nn.PARTITION_NAME: "layers"})
        layer = scanned(self.config, self.dtype, self.moe, self.absorbed, name="layers")
        return layer(x, positions, caches)

"""The pre-norm decoder layer and the stack of identical layers.

In the checkpoint layout, layers of one kind are stacked on a leading `layers` axis and run with
`nn.scan`, so tracing and compiling cost the same for 4 layers or 61. In an unrolled layout
(jaxmtp.layout, for decoding) each layer has its own parameters and cache and runs in turn.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp.cache import MLACache
from jaxmtp.config import ModelConfig
from jaxmtp.layers import Dtype, RMSNorm
from jaxmtp.layout import CHECKPOINT, Layout
from jaxmtp.mla import MLA
from jaxmtp.moe import MLP, MoE


class DecoderLayer(nn.Module):
    """Pre-norm block: x + MLA(norm(x)), then + FFN(norm(x)); FFN is MoE or the dense MLP."""

    config: ModelConfig
    dtype: Dtype = jnp.float32
    moe: bool = True
    absorbed: bool = False
    layout: Layout = CHECKPOINT

    @nn.compact
    def __call__(self, x, positions, cache: MLACache | None = None):
        """x [B, T, D], positions [B, T], cache: this layer's MLACache or None -> (x, cache)."""
        c, layout = self.config, self.layout
        with jax.named_scope("attention"):
            h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="input_layernorm")(x)
            h, cache = MLA(c, self.dtype, self.absorbed, layout, name="self_attn")(h, positions, cache)
            x = x + h
        with jax.named_scope("moe" if self.moe else "mlp"):
            h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x)
            if self.moe:
                ffn = MoE(c, self.dtype, layout, name="mlp")
            else:
                ffn = MLP(c, c.intermediate_size, self.dtype, layout=layout, name="mlp")
            x = x + ffn(h)
        return x, cache


class LayerStack(nn.Module):
    """`num_layers` DecoderLayers with parameters stacked on axis 0, run by nn.scan; or, in an
    unrolled layout, `layers_0 ..` with their own parameters, run one after the other.

    __call__(x, positions, caches) with caches an MLACache stacked [L, B, S, ...] (unrolled: a tuple
    of L MLACaches [B, S, ...]) or None.
    """

    config: ModelConfig
    num_layers: int
    dtype: Dtype = jnp.float32
    moe: bool = True
    absorbed: bool = False
    layout: Layout = CHECKPOINT

    @nn.compact
    def __call__(self, x, positions, caches: MLACache | tuple[MLACache, ...] | None = None):
        if self.layout.unrolled:
            new = []
            for i in range(self.num_layers):
                layer = DecoderLayer(self.config, self.dtype, self.moe, self.absorbed, self.layout, name=f"layers_{i}")
                x, cache = layer(x, positions, None if caches is None else caches[i])
                new.append(cache)
            return x, (None if caches is None else tuple(new))
        scanned = nn.scan(DecoderLayer, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                          in_axes=(nn.broadcast, 0), length=self.num_layers,
                          metadata_params={nn.PARTITION_NAME: "layers"})
        layer = scanned(self.config, self.dtype, self.moe, self.absorbed, name="layers")
        return layer(x, positions, caches)

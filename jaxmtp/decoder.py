"""The pre-norm decoder layer and the stack of identical layers.

In the checkpoint layout, layers of one kind are stacked on a leading `layers` axis, created by
`nn.scan` and run in a loop over the layer index (`_layer_loop`; training, which collects
intermediates, runs the scan), so tracing and compiling cost the same for 4 layers or 61. In an
unrolled layout (jaxmtp.layout, for decoding) each layer has its own parameters and cache and runs
in turn; the layers of a kind are traced once.
"""

import functools

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
    """`num_layers` DecoderLayers with parameters stacked on axis 0, run by `_layer_loop`; or, in an
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
                cache = None if caches is None else caches[i]
                if self.is_initializing() or self.is_mutable_collection("intermediates"):
                    x, cache = layer(x, positions, cache)
                else:  # the layers share one traced program (see _layer_call)
                    x, cache = _layer_call(self.config, self.dtype, self.moe, self.absorbed, self.layout)(
                        self.variables["params"][layer.name], x, positions, cache)
                new.append(cache)
            return x, (None if caches is None else tuple(new))
        if not (self.is_initializing() or self.is_mutable_collection("intermediates")):
            return _layer_loop(_layer_call(self.config, self.dtype, self.moe, self.absorbed, self.layout),
                               self.variables["params"]["layers"], x, positions, caches)
        scanned = nn.scan(DecoderLayer, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                          in_axes=(nn.broadcast, 0), length=self.num_layers,
                          metadata_params={nn.PARTITION_NAME: "layers"})
        layer = scanned(self.config, self.dtype, self.moe, self.absorbed, name="layers")
        return layer(x, positions, caches)


@functools.cache
def _layer_call(config, dtype, moe, absorbed, layout):
    """(params, x, positions, cache) -> (x, cache): a DecoderLayer's application under jax.jit,
    shared by the unrolled layers of a kind.

    Inside a traced program the layers then share one trace and one lowered function instead of one
    each, which cuts the compile time (benchmarks/compile_cache.py); XLA inlines the calls, so the
    compiled program and its kernels are the same as with the layers traced one by one."""
    layer = DecoderLayer(config, dtype, moe, absorbed, layout)
    return jax.jit(lambda params, x, positions, cache: layer.apply({"params": params}, x, positions, cache))


def _layer_loop(layer, stacked, x, positions, caches):
    """Runs `layer` ((params, x, positions, cache) -> (x, cache)) over the layers of `stacked`
    parameters [L, ...] in a fori_loop, each layer's cache [B, S, ...] read from and written back
    into caches [L, B, S, ...] in place.

    The parameters pass through an optimization barrier with the layer index at the top of each
    iteration, so that XLA cannot treat them as loop invariant: a conversion of a layer's weights
    (FP8 dequantization, or a backend's widening of a dtype its products do not take) then stays
    per layer inside the loop instead of being hoisted out of it as one converted copy of the whole
    stack (`jaxmtp plan` lists the largest temporaries)."""
    def body(i, carry):
        x, caches = carry
        params, i = jax.lax.optimization_barrier((stacked, i))
        own = jax.tree.map(lambda a: a[i], params)
        cache = None if caches is None else jax.tree.map(lambda a: a[i], caches)
        x, cache = layer(own, x, positions, cache)
        if caches is not None:
            caches = jax.tree.map(lambda a, c: jax.lax.dynamic_update_index_in_dim(a, c.astype(a.dtype), i, 0),
                                  caches, cache)
        return x, caches

    return jax.lax.fori_loop(0, jax.tree.leaves(stacked)[0].shape[0], body, (x, caches))

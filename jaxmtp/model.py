"""`Model`: a config plus its parameter pytree, with jitted forward passes; `init`; parameter counts."""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import checks
from jaxmtp.config import ModelConfig
from jaxmtp.layout import CHECKPOINT, Layout, convert, decode_layout
from jaxmtp.quant import QuantizedWeight, is_quantized_param, scale_shape, with_matmul
from jaxmtp.transformer import DeepseekV3


def module(config: ModelConfig, dtype=jnp.float32, absorbed: bool = False, layout: Layout = CHECKPOINT) -> DeepseekV3:
    return DeepseekV3(config, jnp.dtype(dtype), absorbed, layout)


def positions_for(tokens: jax.Array) -> jax.Array:
    """[B, T] -> [B, T] positions 0..T-1 for each row."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def _init_variables(config: ModelConfig, dtype, rng, layout: Layout = CHECKPOINT):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return module(config, dtype, layout=layout).init(rng, tokens, positions_for(tokens), method=DeepseekV3.init_all)


def abstract_params(config: ModelConfig, dtype=jnp.float32, keep_fp8: bool = False, layout: Layout = CHECKPOINT) -> dict:
    """Shapes and dtypes of every parameter in `layout`, without allocating (jax.ShapeDtypeStruct leaves).

    With keep_fp8 (and a quantized config), the weights a checkpoint stores in FP8 are
    QuantizedWeight(e4m3fn values, float32 block scales) instead of dense `dtype` arrays.
    """
    boxed = jax.eval_shape(partial(_init_variables, config, jnp.dtype(dtype), layout=layout), jax.random.key(0))
    params = nn.meta.unbox(boxed)["params"]
    if keep_fp8 and config.quantization is not None:
        params = _quantized_leaves(params, config.quantization.weight_block_size)
    return params


def _quantized_leaves(tree, block, path=()):
    out = {}
    for key, leaf in tree.items():
        p = path + (key,)
        if isinstance(leaf, dict):
            out[key] = _quantized_leaves(leaf, block, p)
        elif is_quantized_param(p):
            out[key] = QuantizedWeight(jax.ShapeDtypeStruct(leaf.shape, jnp.float8_e4m3fn),
                                       jax.ShapeDtypeStruct(scale_shape(leaf.shape, block), jnp.float32), block)
        else:
            out[key] = leaf
    return out


def logical_axes(config: ModelConfig, layout: Layout = CHECKPOINT) -> dict:
    """The logical axis names of every parameter in `layout`, as a pytree of PartitionSpecs."""
    boxed = jax.eval_shape(partial(_init_variables, config, jnp.float32, layout=layout), jax.random.key(0))
    return nn.get_partition_spec(boxed)["params"]


def _tree_size(tree) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Counts from abstract shapes: `main`, `mtp_unique` (what only the MTP module owns) and
    `mtp_with_copies` (plus the embedding and head copies a checkpoint stores in the MTP layer)."""
    params = abstract_params(config)
    mtp = _tree_size(params.get("mtp", {}))
    main = _tree_size(params) - mtp
    copies = 0
    if config.has_mtp:
        copies = 2 * config.vocab_size * config.hidden_size
    return {"main": main, "mtp_unique": mtp, "mtp_with_copies": mtp + copies}


@dataclasses.dataclass
class Model:
    """A DeepSeek-V3-family model: static config, parameter pytree, its device mesh (or None) and
    the layout its parameters are arranged in (jaxmtp.layout; the checkpoint's unless converted)."""

    config: ModelConfig
    params: Any
    mesh: Any = None
    layout: Layout = CHECKPOINT
    _decoding: "Model | None" = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def with_matmul(self, matmul: str) -> "Model":
        """The same model with its FP8-kept weights multiplied by `matmul`: "fp8" (W8A8 block-scaled
        GEMM kernels) or "dequant" (dequantized on the fly). Dense weights are unaffected."""
        return dataclasses.replace(self, params=with_matmul(self.params, matmul))

    def with_layout(self, layout: Layout) -> "Model":
        """The same model with its parameters arranged in `layout` (from the checkpoint layout; new
        arrays, on the mesh with the shardings XLA derives from the old ones)."""
        if layout == self.layout:
            return self
        if self.layout != CHECKPOINT:
            raise ValueError(f"with_layout: converts from the checkpoint layout only; this model is in {self.layout}")
        with self.mesh_context():
            params = jax.jit(partial(convert, layout=layout))(self.params)
        return dataclasses.replace(self, params=params, layout=layout)

    def decoding(self) -> "Model":
        """This model in the layout that decodes fastest (`jaxmtp.layout.decode_layout`), converted
        on first use and kept: `generate` runs on it. Holding both copies doubles the parameters'
        memory; `model = model.decoding()` keeps only the decode copy (forward, mtp_forward and
        generate work in any layout; `save` needs the checkpoint layout)."""
        if self.layout != CHECKPOINT:  # converted already
            return self
        if self._decoding is None:
            self._decoding = self.with_layout(decode_layout(self.config, self.params, self.mesh))
        return self._decoding

    def without_mtp(self) -> "Model":
        """The main model alone: the MTP module's parameters dropped (speculative_k=0 only)."""
        params = {name: tree for name, tree in self.params.items() if name != "mtp"}
        return Model(self.config.replace(num_nextn_predict_layers=0), params, self.mesh, self.layout)

    def mesh_context(self):
        """`jax.set_mesh(mesh)` for the model's mesh (the MoE layers read it to run expert-parallel)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @property
    def dtype(self):
        return jnp.dtype(self.params["embed_tokens"]["weight"].dtype)

    def forward(self, tokens) -> tuple[jax.Array, jax.Array]:
        """tokens [B, T] int -> (logits [B, T, V] float32, post-final-norm hidden [B, T, D])."""
        tokens = checks.token_ids("tokens", tokens, self.config.vocab_size)
        with self.mesh_context():
            return _forward(self.config, self.dtype, self.layout, self.params, tokens)

    def mtp_forward(self, hidden, next_tokens) -> jax.Array:
        """Teacher-forced MTP: slot p combines hidden[:, p] with Emb(next_tokens[:, p]) (= t_{p+1})
        and predicts t_{p+2}. hidden [B, T, D], next_tokens [B, T] -> logits [B, T, V] float32."""
        if not self.config.has_mtp:
            raise ValueError("mtp_forward: this model has no MTP module (num_nextn_predict_layers = 0)")
        next_tokens = checks.token_ids("next_tokens", next_tokens, self.config.vocab_size)
        want = (*next_tokens.shape, self.config.hidden_size)
        if tuple(jnp.shape(hidden)) != want:
            raise ValueError(f"mtp_forward: hidden must be [B, T, hidden_size] = {list(want)} for next_tokens of "
                             f"shape {list(next_tokens.shape)}, found {list(jnp.shape(hidden))}")
        with self.mesh_context():
            return _mtp_forward(self.config, self.dtype, self.layout, self.params, jnp.asarray(hidden, self.dtype),
                                next_tokens)


@partial(jax.jit, static_argnums=(0, 1, 2))
def _forward(config, dtype, layout, params, tokens):
    logits, hidden, _ = module(config, dtype, layout=layout).apply({"params": params}, tokens, positions_for(tokens))
    return logits, hidden


@partial(jax.jit, static_argnums=(0, 1, 2))
def _mtp_forward(config, dtype, layout, params, hidden, next_tokens):
    logits, _, _ = module(config, dtype, layout=layout).apply({"params": params}, hidden, next_tokens,
                                                              positions_for(next_tokens), method=DeepseekV3.mtp_step)
    return logits


def init(config: ModelConfig, seed: int = 0, dtype="float32", mesh=None) -> Model:
    """Random parameters (normal(initializer_range) weights, unit norms, zero routing bias).

    With a mesh (`jaxmtp.make_mesh`), every parameter is created directly with its NamedSharding."""
    dtype = checks.float_dtype("dtype", dtype)
    fn = lambda key: nn.meta.unbox(_init_variables(config, dtype, key))["params"]  # noqa: E731
    shardings = None
    if mesh is not None:
        from jaxmtp.sharding import param_shardings

        shardings = param_shardings(config, abstract_params(config, dtype), mesh)
    return Model(config, jax.jit(fn, out_shardings=shardings)(jax.random.key(seed)), mesh)

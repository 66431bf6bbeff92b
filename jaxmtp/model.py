"""`Model`: a config plus its parameter pytree, with jitted forward passes; `init`."""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmtp import checks
from jaxmtp.config import ModelConfig
from jaxmtp.errors import InputError
from jaxmtp.layout import CHECKPOINT, Layout, convert, convert_on_host, decode_layout, platform
from jaxmtp.params import abstract_params, init_variables, module, param_shardings, positions_for
from jaxmtp.quant import with_matmul
from jaxmtp.sharding import context_mesh
from jaxmtp.transformer import DeepseekV3


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
        q = self.config.quantization
        return dataclasses.replace(self, params=with_matmul(self.params, matmul, q.scale_fmt if q else None))

    def with_layout(self, layout: Layout) -> "Model":
        """The same model with its parameters arranged in `layout` (from the checkpoint layout; new
        arrays, on the mesh with the shardings XLA derives from the old ones)."""
        if layout == self.layout:
            return self
        if self.layout != CHECKPOINT:
            raise InputError(f"with_layout: converts from the checkpoint layout only; this model is in {self.layout}")
        converted = partial(convert, layout=layout, config=self.config)
        if self.mesh is None and platform(self.params) == "cpu":
            return dataclasses.replace(self, params=convert_on_host(self.params, layout, self.config), layout=layout)
        if self.mesh is None:  # op by op: no compile of the whole conversion before the first run
            return dataclasses.replace(self, params=converted(self.params), layout=layout)
        with self.mesh_context():
            params = jax.jit(converted)(self.params)
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
        """`jax.set_mesh(mesh)` for the model's mesh (the MoE layers read it to run expert-parallel).
        The jitted functions (apply_forward, jaxmtp.decoding.start and advance) refuse parameters
        placed on a mesh outside it; the methods here and jaxmtp.generate enter it themselves."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @property
    def dtype(self):
        return jnp.dtype(self.params["embed_tokens"]["weight"].dtype)

    def forward(self, tokens) -> tuple[jax.Array, jax.Array]:
        """tokens [B, T] int -> (logits [B, T, V] float32, post-final-norm hidden [B, T, D])."""
        tokens = checks.token_ids("tokens", tokens, self.config.vocab_size)
        with self.mesh_context():
            return apply_forward(self.config, self.dtype, self.layout, self.params, tokens)

    def mtp_forward(self, hidden, next_tokens) -> jax.Array:
        """Teacher-forced MTP: slot p combines hidden[:, p] with Emb(next_tokens[:, p]) (= t_{p+1})
        and predicts t_{p+2}. hidden [B, T, D], next_tokens [B, T] -> logits [B, T, V] float32."""
        if not self.config.has_mtp:
            raise InputError("mtp_forward: this model has no MTP module (num_nextn_predict_layers = 0)")
        next_tokens = checks.token_ids("next_tokens", next_tokens, self.config.vocab_size)
        want = (*next_tokens.shape, self.config.hidden_size)
        if tuple(jnp.shape(hidden)) != want:
            raise InputError(f"mtp_forward: hidden must be [B, T, hidden_size] = {list(want)} for next_tokens of "
                             f"shape {list(next_tokens.shape)}, found {list(jnp.shape(hidden))}")
        with self.mesh_context():
            return apply_mtp_forward(self.config, self.dtype, self.layout, self.params, jnp.asarray(hidden, self.dtype),
                                next_tokens)


@partial(jax.jit, static_argnums=(0, 1, 2))
def apply_forward(config, dtype, layout, params, tokens):
    """The main model over tokens [B, T] at positions 0..T-1 -> (logits [B, T, V], hidden [B, T, D]).
    Parameters placed on a mesh need it set (`Model.mesh_context`); without it this refuses them."""
    context_mesh(params, "apply_forward")
    logits, hidden, _ = module(config, dtype, layout=layout).apply({"params": params}, tokens, positions_for(tokens))
    return logits, hidden


@partial(jax.jit, static_argnums=(0, 1, 2))
def apply_mtp_forward(config, dtype, layout, params, hidden, next_tokens):
    """The MTP layer over main hidden states [B, T, D] and the tokens after them [B, T] -> logits
    [B, T, V] of the token after those. Parameters placed on a mesh need it set, as for apply_forward."""
    context_mesh(params, "apply_mtp_forward")
    logits, _, _ = module(config, dtype, layout=layout).apply({"params": params}, hidden, next_tokens,
                                                              positions_for(next_tokens), method=DeepseekV3.mtp_step)
    return logits


def init(config: ModelConfig, seed: int = 0, dtype="float32", mesh=None) -> Model:
    """Random parameters (normal(initializer_range) weights, unit norms, zero routing bias).

    With a mesh (`jaxmtp.make_mesh`), every parameter is created directly with its NamedSharding."""
    dtype = checks.float_dtype("dtype", dtype)
    fn = lambda key: nn.meta.unbox(init_variables(config, dtype, key))["params"]  # noqa: E731
    shardings = None
    if mesh is not None:
        shardings = param_shardings(config, abstract_params(config, dtype), mesh)
    return Model(config, jax.jit(fn, out_shardings=shardings)(jax.random.key(seed)), mesh)

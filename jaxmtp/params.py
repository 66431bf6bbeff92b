"""Parameter shapes, logical axes, shardings and counts of a config, without allocating.

All come from the Flax modules' own `init` under jax.eval_shape; `module` builds the Flax module
for a config."""

from __future__ import annotations

import functools
import warnings
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmtp.config import ModelConfig
from jaxmtp.errors import InputError
from jaxmtp.layout import CHECKPOINT, Layout
from jaxmtp.quant import QuantizedWeight, is_quantized_param, scale_shape
from jaxmtp.sharding import ShardingWarning, spec, split
from jaxmtp.transformer import DeepseekV3


def module(config: ModelConfig, dtype=jnp.float32, absorbed: bool = False, layout: Layout = CHECKPOINT) -> DeepseekV3:
    """The Flax model for `config`, computing in `dtype`, attending in the absorbed form (decode
    and verify passes) or expanded (prefill), reading parameters in `layout`."""
    return DeepseekV3(config, jnp.dtype(dtype), absorbed, layout)


def positions_for(tokens: jax.Array) -> jax.Array:
    """[B, T] -> [B, T] positions 0..T-1 for each row."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def init_variables(config: ModelConfig, dtype, rng, layout: Layout = CHECKPOINT):
    """Random variables of every module (main stacks and MTP layer) in `layout`, from key `rng`."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return module(config, dtype, layout=layout).init(rng, tokens, positions_for(tokens), method=DeepseekV3.init_all)


def abstract_params(config: ModelConfig, dtype=jnp.float32, keep_fp8: bool = False, layout: Layout = CHECKPOINT) -> dict:
    """Shapes and dtypes of every parameter in `layout`, without allocating (jax.ShapeDtypeStruct leaves).

    With keep_fp8 (and a quantized config), the weights a checkpoint stores in FP8 are
    QuantizedWeight(e4m3fn values, float32 block scales) instead of dense `dtype` arrays.
    """
    params = nn.meta.unbox(_abstract_variables(config, jnp.dtype(dtype), layout))["params"]
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
    return nn.get_partition_spec(_abstract_variables(config, jnp.dtype(jnp.float32), layout))["params"]


@functools.lru_cache(maxsize=16)
def _abstract_variables(config: ModelConfig, dtype, layout: Layout):
    """The boxed variables of a fresh init, traced once per config, dtype and layout: tracing the
    whole model takes a second or more, and one load asks for its shapes and its axis names several
    times (callers get new trees: unbox and get_partition_spec map over it)."""
    return jax.eval_shape(partial(init_variables, config, dtype, layout=layout), jax.random.key(0))


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


def param_shardings(config: ModelConfig, params, mesh: Mesh, layout: Layout = CHECKPOINT):
    """NamedSharding for every leaf of `params` (abstract or real, in `layout`, default the
    checkpoint's; QuantizedWeight leaves get one for the values and one for the block scales, cut
    along the same axes where they divide).

    A parameter whose dimension a mesh axis does not divide stays whole over that axis: one
    ShardingWarning lists them, grouped by reason (`unsplit_parameters`; Python shows each distinct
    warning once). The block scales of FP8 weights are left out of it: they are 1 / 16384 of their
    values, kept whole where their blocks do not divide. A `tensor` or `expert` axis that splits no
    parameter at all is refused: every device along it would hold the same copy of everything."""
    shardings, unsplit = _split_parameters(config, params, mesh, layout)
    used = {axis for leaf in jax.tree.leaves(shardings) for axis in _mesh_axes(leaf.spec)}
    for axis in ("expert", "tensor"):
        if mesh.shape.get(axis, 1) > 1 and axis not in used:
            reasons = "; ".join(reason for reason in unsplit if axis in reason.split(" by ", 1)[1])
            raise InputError(f"mesh axis {axis}={mesh.shape[axis]} splits no parameter of this model"
                             + (f" ({reasons})" if reasons else "")
                             + f": use {axis}=1 or a size that divides them")
    if unsplit:
        warnings.warn(describe_unsplit(unsplit, mesh), ShardingWarning, stacklevel=2)
    return shardings


def unsplit_parameters(config: ModelConfig, params, mesh: Mesh,
                       layout: Layout = CHECKPOINT) -> dict[str, list[str]]:
    """{reason: parameter paths} for the parameters that stay whole over a mesh axis their rule
    splits them over (reason as jaxmtp.sharding.split words it: "vocab 1000 is not divisible by
    tensor=3"); {} where every rule applies."""
    return _split_parameters(config, params, mesh, layout)[1]


def describe_unsplit(unsplit: dict[str, list[str]], mesh: Mesh, shown: int = 3) -> str:
    """One message for `unsplit_parameters`: a line per reason with up to `shown` of its parameters."""
    sizes = " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    lines = []
    for reason, paths in unsplit.items():
        more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
        lines.append(f"  {reason}: {', '.join(paths[:shown])}{more} stay whole over it")
    head = f"on the mesh {sizes}, parameters stay whole where their sharding rule would split them:"
    return "\n".join([head, *lines])


def _split_parameters(config, params, mesh, layout):
    """(param_shardings's tree, {reason: paths}) from jaxmtp.sharding.split."""
    unsplit: dict[str, list[str]] = {}

    def one(path, logical, leaf):
        name = "/".join(str(getattr(key, "key", key)) for key in path)
        values = leaf.value if isinstance(leaf, QuantizedWeight) else leaf
        value_spec, reasons = split(tuple(logical), values.shape, mesh)
        for reason in reasons:
            unsplit.setdefault(reason, []).append(name)
        if isinstance(leaf, QuantizedWeight):
            return leaf.replace(value=NamedSharding(mesh, value_spec),
                                scale=NamedSharding(mesh, spec(tuple(logical), leaf.scale.shape, mesh)))
        return NamedSharding(mesh, value_spec)

    shardings = jax.tree_util.tree_map_with_path(one, logical_axes(config, layout), params,
                                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
    return shardings, unsplit


def _mesh_axes(partition: PartitionSpec):
    """The mesh axis names a PartitionSpec splits over."""
    for entry in partition:
        yield from (entry if isinstance(entry, tuple) else () if entry is None else (entry,))

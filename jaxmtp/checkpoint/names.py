"""The one mapping between jaxmtp parameter paths and HF checkpoint tensor names.

jaxmtp names its parameters after the HF modules, so the mapping is mostly structural: a stacked
layer index becomes `model.layers.{i}`, a stacked expert index becomes `mlp.experts.{e}`, and the
MTP module lives at layer index `num_hidden_layers`.
"""

from __future__ import annotations

import numpy as np

from jaxmtp.config import ModelConfig
from jaxmtp.quant import is_quantized_param, scale_shape

_MTP_OWN = {"shared_head_norm": "shared_head.norm"}
# Tensors a checkpoint stores in the MTP layer that are copies of the main model's.
MTP_COPIES = {"embed_tokens.weight": ("embed_tokens", "weight"), "shared_head.head.weight": ("lm_head", "weight")}


def index_dims(path: tuple[str, ...]) -> int:
    """How many leading axes of this parameter are stacking axes (layer, expert)."""
    return int(path[0] in ("dense_layers", "moe_layers")) + int("experts" in path)


def hf_name(path: tuple[str, ...], index: tuple[int, ...], config: ModelConfig) -> str:
    """HF tensor name of the slice `index` (leading stacking indices) of parameter `path`."""
    head, rest = path[0], list(path[1:])
    if head in ("dense_layers", "moe_layers"):
        layer = index[0] + (config.first_k_dense_replace if head == "moe_layers" else 0)
        rest, index = rest[1:], index[1:]  # drop the scan's "layers" level
    elif head == "mtp":
        layer = config.num_hidden_layers
        if rest[0] == "block":
            rest = rest[1:]
        else:
            rest[0] = _MTP_OWN.get(rest[0], rest[0])
    else:
        return ("lm_head." if head == "lm_head" else f"model.{head}.") + ".".join(rest)
    if "experts" in rest:  # [..., "experts", "gate_proj"] -> experts.{e}.gate_proj.weight
        rest = rest[:-1] + [str(index[0]), rest[-1], "weight"]
    return f"model.layers.{layer}." + ".".join(rest)


def expected_tensors(params, config: ModelConfig):
    """(hf name, param path, stacking index, tensor shape, role) for every tensor the model needs.

    `params` is a (possibly abstract) nested dict of arrays. role is "dense" for a plain tensor, or
    "fp8" and "scale" for the two tensors of a weight the config stores block-quantized.
    """
    quantized = config.quantization is not None
    for path, leaf in _flatten(params):
        n = index_dims(path)
        shape = tuple(leaf.shape[n:])
        fp8 = quantized and is_quantized_param(path)
        for index in np.ndindex(*leaf.shape[:n]):
            name = hf_name(path, index, config)
            if fp8:
                yield name, path, index, shape, "fp8"
                yield name + "_scale_inv", path, index, scale_shape(shape, config.quantization.weight_block_size), "scale"
            else:
                yield name, path, index, shape, "dense"


def mtp_copy_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Checkpoint names of the MTP layer's embedding/head copies -> the main parameter they copy."""
    if not config.has_mtp:
        return {}
    copies = dict(MTP_COPIES)
    if config.tie_word_embeddings:
        copies["shared_head.head.weight"] = ("embed_tokens", "weight")
    return {f"model.layers.{config.num_hidden_layers}.{k}": v for k, v in copies.items()}


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def leaf_at(tree, path: tuple[str, ...]):
    """tree[path[0]][path[1]]..."""
    for key in path:
        tree = tree[key]
    return tree

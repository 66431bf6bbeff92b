"""Writing checkpoints: the HF layout (sharded safetensors + index, FP8 + scales for kept weights,
the MTP module at layer index num_hidden_layers) or an orbax-checkpoint directory."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import save_file

from jaxmtp.checkpoint.hf import INDEX_FILE, _leaf
from jaxmtp.checkpoint.names import expected_tensors
from jaxmtp.config import ModelConfig
from jaxmtp.model import Model, abstract_params
from jaxmtp.quant import QuantizedWeight, is_quantized

ORBAX_META = "jaxmtp_orbax.json"


def saved_config(model):
    """The config as saved: quantization_config only when weights are really kept in FP8."""
    return model.config if is_quantized(model.params) else model.config.replace(quantization=None)


def save_hf(model, path: str, max_shard_bytes: int = 4 << 30):
    """Writes config.json, model-XXXXX-of-YYYYY.safetensors and model.safetensors.index.json."""
    os.makedirs(path, exist_ok=True)
    config = saved_config(model)
    raw = config.to_hf_config()
    raw["dtype"] = str(model.dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    shards, current, size = [], {}, 0
    for name, tensor_path, index, _, role in expected_tensors(model.params, config):
        leaf = _leaf(model.params, tensor_path)
        array = leaf if role == "dense" else (leaf.value if role == "fp8" else leaf.scale)
        value = np.asarray(array[index])
        if current and size + value.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_orbax(model, path: str):
    """An orbax-checkpoint of the parameter tree under `params/`, with config.json beside it."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf_config(), f, indent=2)
    with open(os.path.join(path, ORBAX_META), "w") as f:
        json.dump({"dtype": str(model.dtype), "quantized": is_quantized(model.params)}, f)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, "params"), model.params)


def load_orbax(path: str, dtype=None, quantized: str = "dequantize", mesh=None):
    """Restores a save_orbax directory; orbax casts the dense parameters to `dtype` and, with a
    mesh, places each parameter with its NamedSharding as it reads. FP8-kept weights stay
    QuantizedWeight with quantized="keep", else become dense `dtype`."""
    path = os.path.abspath(path)
    config = ModelConfig.from_hf_config(path)
    with open(os.path.join(path, ORBAX_META)) as f:
        meta = json.load(f)
    dtype = jnp.dtype(dtype or meta["dtype"])
    target = abstract_params(config, dtype, keep_fp8=meta["quantized"])
    if mesh is not None:
        from jaxmtp.sharding import param_shardings

        target = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s), target,
                              param_shardings(config, target, mesh))
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(os.path.join(path, "params"), target)
    if meta["quantized"] and quantized == "dequantize":
        params = jax.tree.map(lambda leaf: leaf.dequantize(dtype) if isinstance(leaf, QuantizedWeight) else leaf,
                              params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))
        config = config.replace(quantization=None)
    return Model(config, params, mesh)


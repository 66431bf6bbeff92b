"""Reading HF-layout checkpoint directories: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import json
import os
import warnings

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxmtp.checkpoint.names import expected_tensors, mtp_copy_names
from jaxmtp.config import ModelConfig
from jaxmtp.errors import CheckpointError
from jaxmtp.model import Model, abstract_params

INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOAT_KINDS = ("F32", "BF16", "F16", "F64")


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint, from its index when it has one."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index ({e!r})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(directory, name)):
                raise CheckpointError(f"{index_path}: names file {name!r}, which does not exist")
        return [os.path.join(directory, name) for name in files]
    files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        pickled = [n for n in os.listdir(directory) if n.endswith(_PICKLE_SUFFIXES)]
        if pickled:
            raise CheckpointError(f"{directory}: only pickle-based weights ({pickled[0]}); jaxmtp never unpickles, "
                                  "convert them to safetensors first")
        raise CheckpointError(f"{directory}: no *.safetensors files and no {INDEX_FILE}")
    return [os.path.join(directory, name) for name in files]


def default_dtype(directory: str):
    """The dtype a checkpoint's config.json declares (`dtype` or `torch_dtype`), else float32."""
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return jnp.dtype(name)


def load_hf(directory: str, dtype=None) -> Model:
    """Loads an HF-layout checkpoint into a Model with parameters of `dtype`.

    Every tensor the config implies must be present with its exact shape, and every tensor in the
    files must be one the model uses; anything else raises CheckpointError naming file and tensor.
    """
    config = ModelConfig.from_hf_config(directory)
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype(directory)
    target = abstract_params(config, dtype)
    expected = {name: (path, index, shape) for name, path, index, shape in expected_tensors(target, config)}
    copies = mtp_copy_names(config)
    buffers = _allocate(target)
    seen, copy_values = set(), {}
    for file in checkpoint_files(directory):
        for name, value in _read_file(file):
            if name in copies:
                copy_values[name] = value
                continue
            if name not in expected:
                raise CheckpointError(f"{file}: unexpected tensor {name!r} for this config "
                                      f"({config.num_hidden_layers} layers, {config.n_routed_experts} experts, "
                                      f"{config.num_nextn_predict_layers} MTP)")
            path, index, shape = expected[name]
            if value.shape != shape:
                raise CheckpointError(f"{file}: tensor {name!r} has shape {list(value.shape)}, "
                                      f"expected {list(shape)} from config.json")
            _leaf(buffers, path)[index] = value
            seen.add(name)
    missing = [name for name in expected if name not in seen]
    if missing:
        raise CheckpointError(f"{directory}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    _check_copies(copy_values, copies, buffers)
    params = _map(buffers, jnp.asarray)
    return Model(config, params)


def _read_file(file: str):
    """Yields (name, numpy array) for each tensor of one safetensors file, memory-mapped."""
    try:
        handle = safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from None
    with handle:
        for name in handle.keys():
            kind = handle.get_slice(name).get_dtype()
            if kind not in _FLOAT_KINDS:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {kind}; expected one of {_FLOAT_KINDS}")
            try:
                yield name, handle.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from None


def _check_copies(copy_values, copies, buffers):
    """The MTP layer's embedding/head copies are shared with the main model: warn if they differ."""
    for name, value in copy_values.items():
        main = _leaf(buffers, copies[name])
        if value.shape != main.shape or not np.array_equal(value.astype(main.dtype), main):
            warnings.warn(f"{name} differs from the main model's {'.'.join(copies[name])}; "
                          "the main model's tensor is used for the MTP module", stacklevel=3)


def _allocate(tree):
    return _map(tree, lambda leaf: np.empty(leaf.shape, leaf.dtype))


def _map(tree, fn):
    return {k: _map(v, fn) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree

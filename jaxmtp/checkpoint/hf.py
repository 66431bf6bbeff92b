"""Reading checkpoint directories: config.json + safetensors in the HF layout (single file or
sharded) or DeepSeek's converted `model{rank}-mp{n}` layout; bf16/f32 tensors and block-scaled FP8
weights with their `weight_scale_inv`.

Tensors are read one at a time from memory-mapped files and placed straight into their slot of the
stacked parameter buffers, so host memory holds the parameters plus one tensor in flight. With a
mesh, each device's block is read on its own (`jaxmtp.checkpoint.sharded`), from the rank files too
(`jaxmtp.checkpoint.official.RankTensorFiles`), and no whole host copy is made.
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxmtp import checks
from jaxmtp.checkpoint import diagnose, official
from jaxmtp.checkpoint.names import expected_tensors, hf_name, leaf_at, mtp_copy_names
from jaxmtp.checkpoint.sharded import TensorFiles, load_onto_mesh
from jaxmtp.config import ModelConfig
from jaxmtp.errors import CheckpointError, ConfigError
from jaxmtp.model import Model
from jaxmtp.memory import check_fits
from jaxmtp.params import abstract_params, param_shardings
from jaxmtp.quant import dequantize

# safetensors' numpy backend looks FP8 dtypes up on the numpy module; ml_dtypes provides them.
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if not hasattr(np, _name):
        setattr(np, _name, getattr(ml_dtypes, _name))

INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPES_BY_ROLE = {"dense": ("F32", "BF16", "F16", "F64"), "fp8": ("F8_E4M3",), "scale": ("F32",)}


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
    field = "dtype" if raw.get("dtype") else "torch_dtype"
    try:
        return checks.float_dtype(field, raw.get(field) or "float32")
    except ValueError as e:
        raise ConfigError(f"{os.path.join(directory, 'config.json')}: {e}") from None


def load_hf(directory: str, dtype=None, quantized: str = "dequantize", check_finite: bool = True,
            quiet: bool = False, mesh=None, mtp: bool = True, check_memory: bool = True) -> Model:
    """Loads an HF-layout or DeepSeek-converted checkpoint into a Model.

    Args:
      dtype: dtype of the dense parameters; default the one config.json declares.
      quantized: for FP8 checkpoints, "keep" holds QuantizedWeight (e4m3fn values + float32 block
        scales) and "dequantize" produces dense `dtype` arrays.
      check_finite: reject NaN/Inf in any tensor.
      mesh: place every parameter with its NamedSharding, each device receiving only its slice.
      mtp: False loads the main model alone, without the MTP layer's tensors even if present.
      check_memory: refuse, before reading any tensor, parameters that cannot fit the devices
        (jaxmtp.memory.check_fits).
    Every tensor the config implies must be present with its exact shape and dtype, and every
    tensor in the files must be one the model uses; anything else raises CheckpointError.
    """
    config = ModelConfig.from_hf_config(directory)
    ranks = official.rank_files(directory)
    if ranks and config.has_mtp:
        warnings.warn(f"{directory}: DeepSeek's converted model{{rank}}-mp{{n}} format carries no MTP layer; "
                      "loading the main model only", stacklevel=3)
        mtp = False
    # Names of the MTP layer's tensors, left unread without it (str.startswith of () is False).
    skipped = (f"model.layers.{config.num_hidden_layers}.",) if config.has_mtp and not mtp else ()
    config = config if mtp else config.replace(num_nextn_predict_layers=0)
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype(directory)
    keep = quantized == "keep" and config.quantization is not None
    target = abstract_params(config, dtype, keep_fp8=keep)
    expected = {name: rest for name, *rest in expected_tensors(target, config)}
    copies = mtp_copy_names(config)
    files = ranks or checkpoint_files(directory)
    if not ranks:
        _check_architecture(files, config, skipped)
    shardings = None if mesh is None else param_shardings(config, target, mesh)
    if check_memory:
        check_fits(target, shardings, staged_on_host=mesh is None, source=directory)
    if mesh is not None:
        return Model(config, _load_onto_mesh(files, ranks, target, shardings, expected, copies, config, keep,
                                             check_finite, quiet, skipped), mesh)
    buffers = jax.tree.map(lambda leaf: _aligned_empty(leaf.shape, leaf.dtype), target)
    placer = _Placer(buffers, keep, config)
    copy_values = {}
    with _progress(files, quiet) as bar:
        source = official.rank_tensors(files, expected, config, bar) if ranks else _tensors(files, bar)
        for count, (file, name, kind, value) in enumerate(source, 1):
            bar.set_postfix(tensors=count, refresh=False)
            if name.startswith(skipped):
                continue
            if name in copies:
                copy_values[name] = value
                continue
            _check_tensor(file, name, kind, value.shape, expected, config)
            if check_finite and not np.isfinite(value).all():  # ml_dtypes' isfinite: bf16 and FP8 without a copy
                raise CheckpointError(f"{file}: tensor {name!r} contains NaN or Inf")
            path, index, _, role = expected[name]
            placer.place(name, path, index, role, value)
    _check_missing(directory, expected, placer.seen)
    for name, value in copy_values.items():
        _check_copy(name, copies[name], value, leaf_at(buffers, copies[name]))
    return Model(config, _to_device(buffers))


def _load_onto_mesh(files, ranks, target, shardings, expected, copies, config, keep, check_finite, quiet, skipped):
    """Checks every header, then reads each device's block of each parameter on its own (from
    the HF files, or from DeepSeek's rank files where `ranks`)."""
    tensors = official.RankTensorFiles(files, expected, config) if ranks else TensorFiles(files)
    for name, (file, kind, shape) in tensors.where.items():
        if name not in copies and not name.startswith(skipped):
            _check_tensor(file, name, kind, shape, expected, config)
    _check_missing(os.path.dirname(files[0]), expected, tensors.where)
    for name, path in copies.items():
        if name in tensors.where:
            _check_copy(name, path, tensors.read(name), tensors.read(hf_name(path, (), config)))
    with _progress(files, quiet) as bar:
        return load_onto_mesh(tensors, target, shardings, config, keep, check_finite, bar)


class _Placer:
    """Puts each tensor in its slot; in "dequantize" mode pairs an FP8 weight with its scale first."""

    def __init__(self, buffers, keep, config):
        self.buffers, self.keep, self.seen, self.pending = buffers, keep, set(), {}
        self.block = config.quantization.weight_block_size if config.quantization else None

    def place(self, name, path, index, role, value):
        self.seen.add(name)
        leaf = leaf_at(self.buffers, path)
        if role == "dense":
            leaf[index] = value
        elif self.keep:
            (leaf.value if role == "fp8" else leaf.scale)[index] = value
        else:
            weight_name = name.removesuffix("_scale_inv")
            partner = self.pending.pop(weight_name, None)
            if partner is None:  # the other half may come later, from another file
                self.pending[weight_name] = (role, value)
                return
            parts = dict([partner, (role, value)])
            leaf[index] = dequantize(parts["fp8"], parts["scale"], self.block)


def _progress(files, quiet):
    """A progress bar over the files' bytes; the count of tensors read shows beside it."""
    total = sum(os.path.getsize(f) for f in files)
    return tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=quiet)


def _tensors(files, bar):
    """Yields (file, name, safetensors dtype, numpy array) for every tensor, file by file."""
    for file in files:
        tensors = TensorFiles([file])
        for name, (_, kind, _) in tensors.where.items():
            yield file, name, kind, tensors.read(name, bar=bar)


def _check_architecture(files, config, skipped):
    """Compares the sizes the tensor headers imply with config.json before reading any data, so
    that a disagreement names the config field (jaxmtp.checkpoint.diagnose)."""
    shapes = {name: shape for name, (_, _, shape) in TensorFiles(files).where.items() if not name.startswith(skipped)}
    problem = diagnose.mismatch(config, shapes)
    if problem:
        raise CheckpointError(f"{os.path.dirname(files[0])}: {problem}")


def _check_tensor(file, name, kind, shape, expected, config):
    """A tensor the model uses, with the dtype its role allows and the shape config.json implies."""
    if name not in expected:
        raise CheckpointError(f"{file}: unexpected tensor {name!r} for this config "
                              f"({config.num_hidden_layers} layers, {config.n_routed_experts} experts, "
                              f"{config.num_nextn_predict_layers} MTP, "
                              f"{'FP8' if config.quantization else 'no'} quantization_config)")
    _, _, want, role = expected[name]
    if kind not in _DTYPES_BY_ROLE[role]:
        what = {"fp8": "an FP8 weight", "scale": "a block scale", "dense": "a dense tensor"}[role]
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {kind}; as {what} it must be "
                              f"{' or '.join(_DTYPES_BY_ROLE[role])}")
    if tuple(shape) != tuple(want):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(shape)}, "
                              f"expected {list(want)} from config.json")


def _check_missing(directory, expected, seen):
    missing = [name for name in expected if name not in seen]
    if missing:
        raise CheckpointError(f"{directory}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")


def _check_copy(name, path, value, main):
    """The MTP layer's embedding/head copies are shared with the main model (`main`, the tensor at
    parameter `path`): warn if they differ."""
    if value.shape != main.shape or not np.array_equal(value.astype(main.dtype), main):
        warnings.warn(f"{name} differs from the main model's {'.'.join(path)}; "
                      "the main model's tensor is used for the MTP module", stacklevel=4)


def _aligned_empty(shape, dtype, alignment=64):
    """An uninitialised host array whose data starts on an `alignment`-byte boundary, which lets the
    CPU backend adopt it as a device buffer without a copy."""
    dtype = np.dtype(dtype)
    raw = np.empty(int(np.prod(shape)) * dtype.itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)


def _to_device(buffers):
    """Moves buffers to JAX arrays one leaf at a time, releasing each host buffer as it goes (on CPU
    the aligned buffers become the device arrays themselves)."""
    out = {}
    for key in list(buffers):
        leaf = buffers.pop(key)
        out[key] = _to_device(leaf) if isinstance(leaf, dict) else jax.tree.map(
            lambda x: jax.device_put(x, may_alias=True), leaf)
    return out


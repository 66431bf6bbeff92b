"""Loading an HF-layout checkpoint straight onto a mesh: every device's block of every parameter is
read from the safetensors files on its own, slice by slice, so no process ever holds a whole
parameter it does not need (on several hosts, each reads only what its devices keep).

Headers are read first: names, shapes and dtypes are checked against the config before any data.
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxmtp.checkpoint.names import hf_name, index_dims
from jaxmtp.errors import CheckpointError
from jaxmtp.quant import QuantizedWeight, dequantize, is_quantized_param


class TensorFiles:
    """Open safetensors files and where each tensor lives: name -> (file, safetensors dtype, shape)."""

    def __init__(self, files, stack: contextlib.ExitStack):
        self.handles, self.where = {}, {}
        for file in files:
            try:
                handle = stack.enter_context(safe_open(file, framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from None
            self.handles[file] = handle
            for name in handle.keys():
                view = handle.get_slice(name)
                self.where[name] = (file, view.get_dtype(), tuple(view.get_shape()))

    def read(self, name, region=(), bar=None) -> np.ndarray:
        """The tensor `name`, or only `region` (a tuple of slices) of it; `bar` counts the bytes."""
        file = self.where[name][0]
        try:
            value = self.handles[file].get_slice(name)[region] if region else self.handles[file].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from None
        if bar is not None:
            bar.update(value.nbytes)
        return value


def load_onto_mesh(tensors: TensorFiles, target, shardings, config, keep: bool, check_finite: bool, bar):
    """Global arrays for the abstract `target` tree, each device's block read on its own.

    target: abstract parameters (QuantizedWeight leaves when FP8 is kept); shardings: the matching
    NamedSharding tree. In "dequantize" mode an FP8 weight's block is value x the scales covering it.
    """
    block = config.quantization.weight_block_size if config.quantization else None

    def build(path, abstract, sharding):
        if isinstance(abstract, QuantizedWeight):
            parts = [_leaf_array(tensors, path, leaf, shard, config, bar, check_finite, part)
                     for leaf, shard, part in ((abstract.value, sharding.value, "value"),
                                               (abstract.scale, sharding.scale, "scale"))]
            return abstract.replace(value=parts[0], scale=parts[1])
        part = "dequantize" if block is not None and is_quantized_param(path) else "dense"
        return _leaf_array(tensors, path, abstract, sharding, config, bar, check_finite, part, block)

    return _map_with_path(build, target, shardings)


def _leaf_array(tensors, path, abstract, sharding, config, bar, check_finite, part, block=None):
    """One parameter as a global array; a block's stacked entries (layers, experts) are separate
    checkpoint tensors, each read only over the block's trailing-axis region."""
    stacked = index_dims(path)
    cached = {}

    def block_of(index):
        key = tuple((s.start, s.stop) for s in index)
        if key not in cached:  # devices holding the same block (replicas) share one read
            cached[key] = _read_block(tensors, path, abstract, index, stacked, config, part, block, bar, check_finite)
        return cached[key]

    return jax.make_array_from_callback(abstract.shape, sharding, block_of)


def _read_block(tensors, path, abstract, index, stacked, config, part, block, bar, check_finite):
    index = tuple(slice(*s.indices(n)) for s, n in zip(index + (slice(None),) * abstract.ndim, abstract.shape))
    positions = [range(s.start, s.stop) for s in index[:stacked]]
    region = index[stacked:]
    out = np.empty([s.stop - s.start for s in index], abstract.dtype)
    for local, position in zip(itertools.product(*[range(len(r)) for r in positions]), itertools.product(*positions)):
        name = hf_name(path, position, config)
        if part == "dequantize":
            value = _dequantized_region(tensors, name, region, block, bar)
        else:
            value = tensors.read(name + ("_scale_inv" if part == "scale" else ""), region, bar)
        if check_finite and not np.isfinite(value).all():
            raise CheckpointError(f"{tensors.where[name][0]}: tensor {name!r} contains NaN or Inf")
        out[local] = value
    return out


def _dequantized_region(tensors, name, region, block, bar):
    """value x block scale over `region` (rows, cols) of an FP8 weight, reading only the scale
    blocks that cover it."""
    (rows, cols), (b0, b1) = region, block
    value = tensors.read(name, region, bar)
    scale = tensors.read(name + "_scale_inv", (slice(rows.start // b0, -(-rows.stop // b0)),
                                                slice(cols.start // b1, -(-cols.stop // b1))), bar)
    return dequantize(value, scale, block, offset=(rows.start % b0, cols.start % b1))


def _map_with_path(fn, target, shardings, prefix=()):
    return {key: _map_with_path(fn, value, shardings[key], prefix + (key,)) if isinstance(value, dict)
            else fn(prefix + (key,), value, shardings[key]) for key, value in target.items()}

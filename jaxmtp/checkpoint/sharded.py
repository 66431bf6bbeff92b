"""Loading an HF-layout checkpoint straight onto a mesh: every device's block of every parameter is
read from the safetensors files on its own, slice by slice, so no process ever holds a whole
parameter it does not need (on several hosts, each reads only what its devices keep).

Headers are read first: names, shapes and dtypes are checked against the config before any data.
"""

from __future__ import annotations

import itertools
import json
import math

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxmtp.checkpoint.names import hf_name, index_dims
from jaxmtp.errors import CheckpointError
from jaxmtp.quant import QuantizedWeight, dequantize, is_quantized_param


# safetensors dtype names -> numpy dtypes (little-endian, as the format stores them).
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
                 "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": "<i8", "I32": "<i4",
                 "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


class TensorFiles:
    """Safetensors files and where each tensor lives: name -> (file, safetensors dtype, shape).

    Headers are read (and checked by safetensors) once; each read maps its tensor's bytes, copies
    the region asked for and unmaps them, so the pages of the files read so far do not stay in the
    process's memory: reading a whole checkpoint holds what was copied out, not the files."""

    def __init__(self, files):
        self.where, self.offsets = {}, {}
        for file in files:
            try:
                with safe_open(file, framework="numpy") as handle:
                    for name in handle.keys():
                        view = handle.get_slice(name)
                        self.where[name] = (file, view.get_dtype(), tuple(view.get_shape()))
                self.offsets.update(_data_offsets(file))
            except (SafetensorError, OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from None

    def read(self, name, region=(), bar=None) -> np.ndarray:
        """The tensor `name`, or only `region` (a tuple of slices) of it; `bar` counts the bytes."""
        file, kind, shape = self.where[name]
        try:
            value = _read_region(file, self.offsets[name], _NUMPY_DTYPES[kind], shape, region)
        except KeyError:  # a dtype with no numpy equivalent here: safetensors reads it (and the caller refuses it)
            with safe_open(file, framework="numpy") as handle:
                value = handle.get_slice(name)[region] if region else handle.get_tensor(name)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({e})") from None
        if bar is not None:
            bar.update(value.nbytes)
        return value


def _data_offsets(file) -> dict[str, int]:
    """name -> the file offset of the tensor's first byte, from the safetensors header (8 bytes of
    little-endian header length, then the JSON header; data offsets count from its end)."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


def _read_region(file, offset, dtype, shape, region) -> np.ndarray:
    """A copy of `region` of the tensor at `offset` of `file`, through a mapping dropped at once."""
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)[region]
    mapped = np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=(math.prod(shape),)).reshape(shape)
    return np.array(mapped[region] if region else mapped)  # the copy; the mapping goes with `mapped`


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
    checkpoint tensors, each read only over the block's trailing-axis region. Each distinct block
    is read once (devices holding the same block, replicas, share the read) and copied to its
    devices before the next is read, so no more than one block is in flight on the host."""
    stacked = index_dims(path)
    readers = {}
    for device, index in sharding.addressable_devices_indices_map(abstract.shape).items():
        readers.setdefault(tuple((s.start, s.stop) for s in index), (index, []))[1].append(device)
    arrays = {}
    for index, devices in readers.values():
        value = _read_block(tensors, path, abstract, index, stacked, config, part, block, bar, check_finite)
        arrays.update((device, jax.device_put(value, device)) for device in devices)
        del value
    return jax.make_array_from_single_device_arrays(abstract.shape, sharding, list(arrays.values()))


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

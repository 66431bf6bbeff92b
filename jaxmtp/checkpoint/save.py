"""Writing checkpoints: the HF layout (sharded safetensors + index, FP8 + scales for kept weights,
the MTP module at layer index num_hidden_layers) or an orbax-checkpoint directory, each written into
a temporary directory and moved into place whole (`write_checkpoint`)."""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import save_file

from jaxmtp.checkpoint.hf import INDEX_FILE
from jaxmtp.checkpoint.names import expected_tensors, leaf_at
from jaxmtp.config import ModelConfig
from jaxmtp.errors import CheckpointError, InputError
from jaxmtp.model import Model
from jaxmtp.params import abstract_params
from jaxmtp.quant import QuantizedWeight, is_quantized

ORBAX_META = "jaxmtp_orbax.json"


def saved_config(model):
    """The config as saved: quantization_config only when weights are really kept in FP8."""
    return model.config if is_quantized(model.params) else model.config.replace(quantization=None)


def save_hf(model, path: str, max_shard_bytes: int = 4 << 30):
    """Writes config.json, model-XXXXX-of-YYYYY.safetensors and model.safetensors.index.json into the
    existing directory `path` (a `write_checkpoint` temporary). The files are planned from the
    tensors' sizes first and written one at a time, each tensor copied to the host (gathered from
    the mesh) as its file is written: the host holds at most one file's tensors."""
    config = saved_config(model)
    spread = [leaf for leaf in jax.tree.leaves(model.params) if not getattr(leaf, "is_fully_addressable", True)]
    if spread:
        raise InputError("format='hf': the parameters span several processes, and safetensors files are written by "
                         "one; write format='orbax' (each process writes its blocks)")
    raw = config.to_hf_config()
    raw["dtype"] = str(model.dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    shards, current, size = [], [], 0
    for name, tensor_path, index, shape, role in expected_tensors(model.params, config):
        leaf = leaf_at(model.params, tensor_path)
        array = leaf if role == "dense" else (leaf.value if role == "fp8" else leaf.scale)
        nbytes = math.prod(shape) * np.dtype(array.dtype).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, array, index))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, entries in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: np.asarray(array[index]) for name, array, index in entries}
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_orbax(model, path: str):
    """An orbax-checkpoint of the parameter tree under `params/`, with config.json beside it, written
    into the existing directory `path` (a `write_checkpoint` temporary)."""
    path = os.path.abspath(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf_config(), f, indent=2)
    with open(os.path.join(path, ORBAX_META), "w") as f:
        json.dump({"dtype": str(model.dtype), "quantized": is_quantized(model.params)}, f)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, "params"), model.params)


AT_FDCWD = -100  # renameat2: paths relative to the working directory
RENAME_EXCHANGE = 2  # renameat2 flag (linux/fs.h): swap the two paths in one step
STAGED = "checkpoint"  # the new checkpoint's name inside its temporary directory


def write_checkpoint(path: str, write, overwrite: bool = False, extra_files=()):
    """Runs `write(directory)` on a new directory inside a fresh temporary one beside `path` (same
    parent, so the final rename is atomic), copies `extra_files` into it under their base names,
    fsyncs all of it and only then moves it to `path`: `path` never shows a half-written checkpoint,
    nor a new config.json beside old weights.

    `path` must be absent or an empty directory unless `overwrite`, which replaces an existing
    directory whole (files that are not part of the new checkpoint go too). On Linux the old and new
    directories are swapped in one step (renameat2 RENAME_EXCHANGE), so `path` is at every instant
    either the whole old checkpoint or the whole new one. Where that call is missing (another OS, an
    old libc, a filesystem without it) the old directory is renamed aside and the new one renamed in:
    between those two renames `path` briefly does not exist. Either way the old checkpoint is deleted
    afterwards.

    A symlink at `path` is followed: the directory it points to is replaced, the link stays.
    An exception while writing deletes the temporary directory and leaves `path` as it was. A process
    killed mid-write leaves its temporary `.{name}.tmp-*` beside `path`: its name starts with a dot,
    nothing loads it, and it can be deleted at any time.
    """
    path = os.path.realpath(path)
    check_destination(path, overwrite)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    temporary = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-")
    try:
        staged = os.path.join(temporary, STAGED)
        os.mkdir(staged)  # unlike mkdtemp's own directory, gets the usual permissions (umask)
        write(staged)
        _copy_in(extra_files, staged)
        _fsync_tree(staged)
        _move_into_place(staged, path, overwrite)
        _fsync(parent)
    finally:
        shutil.rmtree(temporary)  # what a failed write left, or the old checkpoint after a swap


def check_destination(path: str, overwrite: bool):
    """Refuses a destination that is a file, or a non-empty directory without `overwrite`: its content
    would be lost."""
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        if entries and not overwrite:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise CheckpointError(f"{path}: expected a new or empty directory, found one holding {len(entries)} "
                                  f"entries ({shown}); pass overwrite=True (--overwrite) to replace it whole")
    elif os.path.lexists(path):
        raise CheckpointError(f"{path}: expected a directory to write the checkpoint into, found a file")


def _copy_in(files, directory: str):
    """Copies `files` into the checkpoint `directory` under their base names, refusing one that would
    replace a file of the checkpoint itself (its config.json, say)."""
    for file in files:
        target = os.path.join(directory, os.path.basename(file))
        if os.path.lexists(target):
            raise InputError(f"extra file {file}: the checkpoint already has a {os.path.basename(file)} of its own")
        shutil.copy2(file, target)


def _move_into_place(staged: str, path: str, overwrite: bool):
    """Publishes the finished checkpoint `staged` as `path`; any old one ends up beside `staged`, in
    the temporary directory that `write_checkpoint` deletes."""
    if overwrite and os.path.isdir(path):
        if not exchange_directories(staged, path):
            _swap_by_renames(staged, path)
    else:
        os.rename(staged, path)  # onto nothing or an empty directory; the OS refuses a non-empty one


def exchange_directories(a: str, b: str) -> bool:
    """Swaps directories `a` and `b` atomically with Linux's renameat2(RENAME_EXCHANGE); False where
    the OS, libc or filesystem lacks it (ENOSYS, EINVAL)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def _swap_by_renames(staged: str, path: str):
    """Without an atomic exchange: `path` aside (beside `staged`), `staged` in, and the old one back if
    that fails. Between the two renames `path` does not exist."""
    os.rename(path, aside := staged + ".old")
    try:
        os.rename(staged, path)
    except BaseException:
        os.rename(aside, path)
        raise


def _fsync_tree(directory: str):
    """Flushes every file and directory under `directory` to disk before the rename that publishes
    it, so that a crash cannot leave a complete-looking checkpoint of empty or truncated files."""
    for root, _, files in os.walk(directory):
        for file in files:
            _fsync(os.path.join(root, file))
        _fsync(root)


def _fsync(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def orbax_meta(path: str) -> dict:
    """What `save_orbax` recorded beside the parameters: {"dtype": ..., "quantized": bool}."""
    with open(os.path.join(path, ORBAX_META)) as f:
        return json.load(f)


def load_orbax(path: str, dtype=None, quantized: str = "dequantize", mesh=None, check_memory: bool = True):
    """Restores a save_orbax directory; orbax casts the dense parameters to `dtype` and, with a
    mesh, places each parameter with its NamedSharding as it reads (each device's block on its
    own). FP8-kept weights stay QuantizedWeight with quantized="keep", else become dense `dtype`.
    check_memory: refuse parameters that cannot fit the devices before restoring any."""
    from jaxmtp.memory import check_fits
    from jaxmtp.params import param_shardings

    path = os.path.abspath(path)
    config = ModelConfig.from_hf_config(path)
    meta = orbax_meta(path)
    dtype = jnp.dtype(dtype or meta["dtype"])
    target = abstract_params(config, dtype, keep_fp8=meta["quantized"])
    shardings = None if mesh is None else param_shardings(config, target, mesh)
    if check_memory:
        check_fits(target, shardings, source=path)
        if meta["quantized"] and quantized == "dequantize":  # the dense weights, beside the FP8 ones while converted
            dense = abstract_params(config, dtype)
            check_fits(dense, None if mesh is None else param_shardings(config, dense, mesh), source=path)
    if mesh is not None:
        target = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s), target, shardings)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(os.path.join(path, "params"), target)
    if meta["quantized"] and quantized == "dequantize":
        params = jax.tree.map(lambda leaf: leaf.dequantize(dtype) if isinstance(leaf, QuantizedWeight) else leaf,
                              params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))
        config = config.replace(quantization=None)
    return Model(config, params, mesh)


"""Checkpoint reading and writing: HF layout (safetensors) and orbax."""

import os

from jaxmtp.checkpoint.hf import load_hf
from jaxmtp.checkpoint.save import ORBAX_META, load_orbax, save_hf, save_orbax
from jaxmtp.errors import CheckpointError


def load(path, dtype=None, mesh=None, quantized="dequantize", check_finite=False, quiet=False):
    """Loads a checkpoint directory: HF layout (config.json + safetensors [+ index]), DeepSeek's
    converted `model{rank}-mp{n}.safetensors` (with the HF config.json copied beside them; that
    format has no MTP layer), or one written by `save(..., format="orbax")`.

    Args:
      path: the directory.
      dtype: parameter dtype; default the one the checkpoint declares.
      mesh: a `jaxmtp.make_mesh` mesh: every parameter is placed with its NamedSharding.
      quantized: for FP8 checkpoints, "keep" (e4m3fn values + block scales, dequantized on the fly
        in each matmul) or "dequantize" (dense `dtype` weights).
      check_finite: raise CheckpointError on NaN/Inf in any tensor.
      quiet: no progress bar.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if quantized not in ("keep", "dequantize"):
        raise ValueError(f"quantized: expected 'keep' or 'dequantize', found {quantized!r}")
    if os.path.exists(os.path.join(path, ORBAX_META)):
        return load_orbax(path, dtype, quantized, mesh)
    return load_hf(path, dtype, quantized, check_finite, quiet, mesh)


def save(model, path, format="hf", max_shard_bytes=4 << 30):
    """Writes `model` to directory `path` as format "hf" (safetensors files of at most
    `max_shard_bytes` each, plus their index) or "orbax"."""
    if format == "hf":
        save_hf(model, os.fspath(path), max_shard_bytes)
    elif format == "orbax":
        save_orbax(model, os.fspath(path))
    else:
        raise ValueError(f"format: expected 'hf' or 'orbax', found {format!r}")

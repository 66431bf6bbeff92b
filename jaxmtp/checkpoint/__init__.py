"""Checkpoint reading and writing: HF layout (safetensors) and orbax."""

import os

from jaxmtp.checkpoint.hf import load_hf
from jaxmtp.checkpoint.save import ORBAX_META, load_orbax, save_hf, save_orbax
from jaxmtp.errors import CheckpointError
from jaxmtp.layout import CHECKPOINT
from jaxmtp.quant import default_matmul


def load(path, dtype=None, mesh=None, quantized="dequantize", check_finite=False, quiet=False, matmul=None):
    """Loads a checkpoint directory: HF layout (config.json + safetensors [+ index]), DeepSeek's
    converted `model{rank}-mp{n}.safetensors` (with the HF config.json copied beside them; that
    format has no MTP layer), or one written by `save(..., format="orbax")`.

    Args:
      path: the directory.
      dtype: parameter dtype; default the one the checkpoint declares.
      mesh: a `jaxmtp.make_mesh` mesh: every parameter is placed with its NamedSharding.
      quantized: for FP8 checkpoints, "keep" (e4m3fn values + block scales, multiplied as `matmul`
        says) or "dequantize" (dense `dtype` weights).
      check_finite: raise CheckpointError on NaN/Inf in any tensor.
      quiet: no progress bar.
      matmul: with quantized="keep", how the FP8 weights are multiplied: "fp8" (activations
        quantized per 1x128 tile, W8A8 block-scaled GEMM kernels) or "dequant"; default "fp8"
        on GPUs and TPUs with FP8 matmul, else "dequant".
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if quantized not in ("keep", "dequantize"):
        raise ValueError(f"quantized: expected 'keep' or 'dequantize', found {quantized!r}")
    if matmul is not None and quantized != "keep":
        raise ValueError(f"matmul={matmul!r} applies to FP8 weights kept as such: pass quantized='keep'")
    if os.path.exists(os.path.join(path, ORBAX_META)):
        model = load_orbax(path, dtype, quantized, mesh)
    else:
        model = load_hf(path, dtype, quantized, check_finite, quiet, mesh)
    return model.with_matmul(matmul or default_matmul()) if quantized == "keep" else model


def save(model, path, format="hf", max_shard_bytes=4 << 30):
    """Writes `model` to directory `path` as format "hf" (safetensors files of at most
    `max_shard_bytes` each, plus their index) or "orbax"."""
    if model.layout != CHECKPOINT:
        raise ValueError(f"save: the model's parameters are in the decode layout {model.layout}; save the model "
                         "they were converted from (checkpoints hold the checkpoint layout)")
    if format == "hf":
        save_hf(model, os.fspath(path), max_shard_bytes)
    elif format == "orbax":
        save_orbax(model, os.fspath(path))
    else:
        raise ValueError(f"format: expected 'hf' or 'orbax', found {format!r}")

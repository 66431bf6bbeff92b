"""Checkpoint reading and writing: HF layout (safetensors) and orbax."""

import os

import jax
import jax.numpy as jnp

from jaxmtp import checks
from jaxmtp.checkpoint.conversion import convert
from jaxmtp.checkpoint.hf import load_hf
from jaxmtp.checkpoint.save import ORBAX_META, load_orbax, save_hf, save_orbax, write_checkpoint
from jaxmtp.errors import CheckpointError, InputError
from jaxmtp.layout import CHECKPOINT
from jaxmtp import quant

__all__ = ["convert", "fp8_block", "load", "save"]


def load(path, dtype=None, mesh=None, quantized=None, check_finite=True, quiet=False, matmul=None,
         mtp=True, check_memory=True):
    """Loads a checkpoint directory: HF layout (config.json + safetensors [+ index]), DeepSeek's
    converted `model{rank}-mp{n}.safetensors` (with the HF config.json copied beside them; that
    format has no MTP layer), or one written by `save(..., format="orbax")`.

    Args:
      path: the directory.
      dtype: parameter dtype; default the one the checkpoint declares.
      mesh: a `jaxmtp.make_mesh` mesh: every parameter is placed with its NamedSharding.
      quantized: for FP8 checkpoints, "keep" (e4m3fn values + block scales, multiplied as `matmul`
        says) or "dequantize" (dense `dtype` weights); None (the default) keeps them where a
        `matmul` is given or the platform multiplies FP8 (GPUs and TPUs with FP8 matmul), else
        dequantizes them (CPUs): `jaxmtp.quant.fp8_choice` says which and why.
      check_finite: raise CheckpointError on NaN/Inf in any tensor (checked as each tensor is
        read, which adds to the load time: benchmarks/checkpoint_load.py; False skips it).
      quiet: no progress bar.
      matmul: how kept FP8 weights are multiplied (giving one keeps them): "fp8" (activations
        quantized per 1x128 tile, W8A8 block-scaled GEMM kernels, 128x128 weight blocks) or
        "dequant" (dequantized on the fly); default "fp8" on GPUs and TPUs with FP8 matmul, else
        "dequant".
      mtp: False loads the main model alone (no MTP layer, speculative_k=0 only), also from a
        checkpoint whose config promises an MTP layer that its files lack.
      check_memory: before reading any tensor, raise CheckpointError when the parameters cannot
        fit: the bytes each device would hold (from the abstract shapes and shardings) against
        what it has (`jaxmtp.memory.check_fits`). False skips the check.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    quantized, matmul, _ = quant.fp8_plan(quantized, matmul, fp8_block(path) or quant.KERNEL_BLOCK)
    dtype = None if dtype is None else checks.float_dtype("dtype", dtype)
    if os.path.exists(os.path.join(path, ORBAX_META)):
        model = load_orbax(path, dtype, quantized, mesh, check_memory)
        model = model if mtp else model.without_mtp()
        if check_finite:
            _check_finite(path, model.params)
    else:
        model = load_hf(path, dtype, quantized, check_finite, quiet, mesh, mtp, check_memory)
    return model.with_matmul(matmul) if quantized == "keep" else model


def fp8_block(path) -> tuple[int, int] | None:
    """The scale block of the FP8 weights that checkpoint directory `path` stores (its
    config.json's quantization_config; for orbax, only if saved with FP8 weights kept), or None
    where it stores none."""
    from jaxmtp.checkpoint.save import orbax_meta
    from jaxmtp.config import ModelConfig

    path = os.fspath(path)
    quantization = ModelConfig.from_hf_config(path).quantization
    if quantization is None or (os.path.exists(os.path.join(path, ORBAX_META)) and not orbax_meta(path)["quantized"]):
        return None
    return tuple(quantization.weight_block_size)


@jax.jit
def _all_finite(tree):
    """Whether each leaf of `tree` is finite everywhere (one jitted program per tree structure, reused
    by later loads of the same model)."""
    return jax.tree.map(lambda x: jnp.isfinite(x).all(), tree)


def _check_finite(path, params):
    """CheckpointError naming the first parameter with a NaN or Inf (one jitted reduction per leaf,
    on the devices that hold it)."""
    finite = _all_finite(params)
    for key_path, ok in jax.tree_util.tree_flatten_with_path(finite)[0]:
        if not ok:
            raise CheckpointError(f"{path}: parameter {jax.tree_util.keystr(key_path)} contains NaN or Inf")


def save(model, path, format="hf", max_shard_bytes=4 << 30, overwrite=False, extra_files=()):
    """Writes `model` to directory `path` as format "hf" (safetensors files of at most
    `max_shard_bytes` each, plus their index) or "orbax", all at once: the checkpoint is written and
    fsynced in a temporary directory beside `path` and only then moved there, so an interrupted save
    leaves `path` as it was (see `write_checkpoint`).

    Args:
      overwrite: replace an existing non-empty directory `path` whole (an old README, tokenizer or
        training record there goes too); without it such a directory raises CheckpointError.
      extra_files: files copied into the checkpoint under their base names before it appears, e.g.
        the tokenizer.json that goes with the model.
    """
    if model.layout != CHECKPOINT:
        raise InputError(f"save: the model's parameters are in the decode layout {model.layout}; save the model "
                         "they were converted from (checkpoints hold the checkpoint layout)")
    writers = {"hf": lambda directory: save_hf(model, directory, max_shard_bytes),
               "orbax": lambda directory: save_orbax(model, directory)}
    if format not in writers:
        raise InputError(f"format: expected 'hf' or 'orbax', found {format!r}")
    write_checkpoint(os.fspath(path), writers[format], overwrite, extra_files)

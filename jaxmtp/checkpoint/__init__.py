"""Checkpoint reading and writing."""

import os

from jaxmtp.checkpoint.hf import load_hf
from jaxmtp.errors import CheckpointError


def load(path, dtype=None, mesh=None, quantized="dequantize", check_finite=False, quiet=False):
    """Loads a checkpoint directory (HF layout: config.json + safetensors [+ index]).

    Args:
      path: the directory.
      dtype: parameter dtype; default the one config.json declares, else float32.
      mesh: reserved for sharded placement; only None is accepted for now.
      quantized: for FP8 checkpoints, "keep" (e4m3fn values + block scales, dequantized on the fly
        in each matmul) or "dequantize" (dense `dtype` weights).
      check_finite: raise CheckpointError on NaN/Inf in any tensor.
      quiet: no progress bar.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if mesh is not None:
        raise ValueError("load: mesh placement is not implemented yet; pass mesh=None")
    return load_hf(path, dtype, quantized, check_finite, quiet)

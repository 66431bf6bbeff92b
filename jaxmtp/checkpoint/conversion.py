"""Rewriting a checkpoint in another format or dtype, together with the tokenizer files beside it."""

import os
import time

from jaxmtp.checkpoint.save import check_destination

# Files that make a checkpoint usable on text; carried over by `convert` when the source has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def convert(src, dst, format, dtype=None, quantized="keep", overwrite=False, mesh=None):
    """Loads checkpoint `src` and writes it to `dst` as `format` ("hf" or "orbax") with `save`'s
    all-at-once writer, the TOKENIZER_FILES that `src` has going into the same temporary directory:
    `dst` shows either what it held before or the whole converted checkpoint, tokenizer included.

    Args:
      dtype, quantized: as for `load`; the default keeps FP8 weights FP8 with their scales.
      overwrite: as for `save`; a non-empty `dst` is refused before anything is loaded without it.
      mesh: as for `load`: each device reads and holds only its block of each parameter, so no
        device (nor, with a sharded source, the host) holds the whole model; the HF writer then
        gathers one tensor at a time, orbax writes each device's block.

    Returns:
      {"load_s": seconds loading, "save_s": seconds writing, "dtype": the dense dtype written}.
    """
    from jaxmtp.checkpoint import load, save  # jaxmtp.checkpoint imports this module

    check_destination(os.path.realpath(dst), overwrite)
    start = time.perf_counter()
    model = load(src, dtype=dtype, quantized=quantized, quiet=True, mesh=mesh)
    loaded = time.perf_counter()
    carried = [os.path.join(src, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))]
    save(model, dst, format=format, overwrite=overwrite, extra_files=carried)
    return {"load_s": loaded - start, "save_s": time.perf_counter() - loaded, "dtype": str(model.dtype)}

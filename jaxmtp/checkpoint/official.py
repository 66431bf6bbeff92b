"""DeepSeek's own converted format: `model{rank}-mp{n}.safetensors`, one file per tensor-parallel rank.

DeepSeek's `convert.py` renames HF tensors (`self_attn` -> `attn`, `mlp` -> `ffn`, `q_a_proj` -> `wq_a`,
`gate_proj` -> `w1`, `weight_scale_inv` -> `scale`, `e_score_correction_bias` -> `bias`, ...), cuts
column-parallel weights along their output dim and row-parallel ones along their input dim (block scales
cut the same way), gives each rank `n_routed_experts / n` whole experts, copies everything else to every
rank, and drops the MTP layer. Here each HF tensor is rebuilt from its rank slices, one at a time.
"""

from __future__ import annotations

import os
import re

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxmtp.config import ModelConfig
from jaxmtp.errors import CheckpointError

FILE_PATTERN = re.compile(r"model(\d+)-mp(\d+)\.safetensors")
# HF module name -> (converted name, dim cut across ranks or None when every rank holds all of it).
_MODULES = {
    "embed_tokens": ("embed", 0), "input_layernorm": ("attn_norm", None),
    "post_attention_layernorm": ("ffn_norm", None), "q_proj": ("wq", 0), "q_a_proj": ("wq_a", None),
    "q_a_layernorm": ("q_norm", None), "q_b_proj": ("wq_b", 0), "kv_a_proj_with_mqa": ("wkv_a", None),
    "kv_a_layernorm": ("kv_norm", None), "kv_b_proj": ("wkv_b", 0), "o_proj": ("wo", 1), "gate": ("gate", None),
    "gate_proj": ("w1", 0), "down_proj": ("w2", 1), "up_proj": ("w3", 0), "norm": ("norm", None),
    "lm_head": ("head", 0),
}
_RENAMES = (("self_attn", "attn"), ("mlp", "ffn"), ("weight_scale_inv", "scale"), ("e_score_correction_bias", "bias"))


def rank_files(directory: str) -> list[str]:
    """The rank files in rank order, or [] when the directory is not in this format."""
    found = {}
    for name in os.listdir(directory):
        match = FILE_PATTERN.fullmatch(name)
        if match:
            found[name] = (int(match[1]), int(match[2]))
    if not found:
        return []
    sizes = {n for _, n in found.values()}
    if len(sizes) > 1:
        raise CheckpointError(f"{directory}: rank files of different tensor-parallel sizes {sorted(sizes)}")
    n = sizes.pop()
    missing = [f"model{r}-mp{n}.safetensors" for r in range(n) if f"model{r}-mp{n}.safetensors" not in found]
    if missing:
        raise CheckpointError(f"{directory}: rank file(s) {missing} of an mp={n} checkpoint do not exist")
    return [os.path.join(directory, f"model{r}-mp{n}.safetensors") for r in range(n)]


def converted_name(hf_name: str) -> tuple[str, int | None]:
    """HF tensor name -> (its name in the converted files, dim cut across ranks or None)."""
    name = hf_name.removeprefix("model.")
    for old, new in _RENAMES:
        name = name.replace(old, new)
    parts = name.split(".")
    module = parts[-2]
    if module not in _MODULES:
        raise CheckpointError(f"{hf_name}: no converted-format name for module {module!r}")
    new, dim = _MODULES[module]
    parts[-2] = new
    return ".".join(parts), dim


def rank_tensors(files: list[str], hf_names, config: ModelConfig, bar):
    """Yields (file, HF name, safetensors dtype, numpy array) for every tensor, reassembled from the
    ranks; names no HF tensor maps to are yielded unchanged so the caller reports them."""
    n = len(files)
    if config.n_routed_experts % n:
        raise CheckpointError(f"{files[0]}: {config.n_routed_experts} routed experts cannot be split over mp={n} ranks")
    local_experts = config.n_routed_experts // n
    to_hf = {}
    for hf in hf_names:
        name, dim = converted_name(hf)
        to_hf[name] = (hf, dim)
    handles = [_open(file) for file in files]
    try:
        keys = [set(h.keys()) for h in handles]
        for rank, handle in enumerate(handles):
            for name in handle.keys():
                hf, dim = to_hf.get(name, (name, None))
                expert = _expert_index(name)
                if expert is not None:
                    owner = expert // local_experts
                    if rank != owner:
                        raise CheckpointError(f"{files[rank]}: holds expert {expert}, which belongs to rank {owner}")
                elif rank > 0:  # a replicated or cut tensor: rank 0's pass handles it
                    if name not in keys[0]:
                        raise CheckpointError(f"{files[rank]}: tensor {name!r} is absent from {files[0]}")
                    continue
                kind, value = _assemble(files, handles, keys, name, dim if expert is None else None, rank)
                bar.update(value.nbytes)
                yield files[rank], hf, kind, value
    finally:
        for handle in handles:
            handle.__exit__(None, None, None)


def _expert_index(name: str) -> int | None:
    match = re.search(r"\.ffn\.experts\.(\d+)\.", name)
    return int(match[1]) if match else None


def _open(file):
    try:
        return safe_open(file, framework="numpy").__enter__()
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors header ({e})") from None


def _assemble(files, handles, keys, name, dim, rank):
    """The whole tensor: rank `rank`'s copy, or the concatenation of every rank's slice along `dim`."""
    ranks = [rank] if dim is None else range(len(files))
    pieces = []
    for r in ranks:
        if name not in keys[r]:
            raise CheckpointError(f"{files[r]}: tensor {name!r} missing from this rank's slice")
        try:
            kind = handles[r].get_slice(name).get_dtype()
            pieces.append(handles[r].get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{files[r]}: cannot read tensor {name!r} ({e})") from None
    return kind, pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=dim)


class RankTensorFiles:
    """The rank files read as the HF tensors they were cut from, region by region, with the
    interface of `jaxmtp.checkpoint.sharded.TensorFiles` (`where`: HF name -> (file, safetensors
    dtype, HF shape); `read(name, region, bar)`), so that a load onto a mesh reads each device's
    block from the ranks that hold it and never assembles a whole tensor it does not need.
    Tensors whose names map to no HF tensor keep their own names, for the caller to report."""

    def __init__(self, files: list[str], hf_names, config: ModelConfig):
        from jaxmtp.checkpoint.sharded import TensorFiles

        n = len(files)
        if config.n_routed_experts % n:
            raise CheckpointError(f"{files[0]}: {config.n_routed_experts} routed experts cannot be split over "
                                  f"mp={n} ranks")
        local_experts = config.n_routed_experts // n
        ranks = [TensorFiles([file]) for file in files]
        self.where, self.parts = {}, {}  # parts: HF name -> (cut dim or None, [(rank files, name, start, stop)])
        known = set()
        for hf in hf_names:
            name, dim = converted_name(hf)
            known.add(name)
            expert = _expert_index(name)
            holders = [expert // local_experts] if expert is not None else [0] if dim is None else range(n)
            if any(name not in ranks[r].where for r in holders):
                missing = next(r for r in holders if name not in ranks[r].where)
                if dim is not None and expert is None and name in ranks[0].where:
                    raise CheckpointError(f"{files[missing]}: tensor {name!r} missing from this rank's slice")
                continue  # absent: the caller reports it missing
            self._add(hf, name, None if expert is not None else dim, [ranks[r] for r in holders])
        for rank, tensors in enumerate(ranks):
            for name in tensors.where:
                expert = _expert_index(name)
                if expert is not None and expert // local_experts != rank:
                    raise CheckpointError(f"{files[rank]}: holds expert {expert}, which belongs to rank "
                                          f"{expert // local_experts}")
                if expert is None and rank > 0 and name not in ranks[0].where:
                    raise CheckpointError(f"{files[rank]}: tensor {name!r} is absent from {files[0]}")
                if name not in known and name not in self.where:
                    self._add(name, name, None, [tensors])

    def _add(self, hf, name, dim, holders):
        file, kind, shape = holders[0].where[name]
        parts, start = [], 0
        for tensors in holders if dim is not None else holders[:1]:
            size = tensors.where[name][2][dim] if dim is not None else 0
            parts.append((tensors, name, start, start + size))
            start += size
        if dim is not None:
            shape = shape[:dim] + (start,) + shape[dim + 1:]
        self.where[hf] = (file, kind, tuple(shape))
        self.parts[hf] = (dim, parts)

    def read(self, name, region=(), bar=None) -> np.ndarray:
        """The HF tensor `name`, or `region` (a tuple of slices) of it, read from the ranks that hold it."""
        dim, parts = self.parts[name]
        if dim is None:
            tensors, converted, _, _ = parts[0]
            return tensors.read(converted, region, bar)
        shape = self.where[name][2]
        region = tuple(slice(*s.indices(n)) for s, n in zip(tuple(region) + (slice(None),) * len(shape), shape))
        want, pieces = region[dim], []
        for tensors, converted, start, stop in parts:
            low, high = max(want.start, start), min(want.stop, stop)
            if low < high:
                local = region[:dim] + (slice(low - start, high - start),) + region[dim + 1:]
                pieces.append(tensors.read(converted, local, bar))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=dim)

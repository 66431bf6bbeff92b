"""Explaining a checkpoint that disagrees with its config.json: the architecture sizes that the HF
tensor names and shapes imply, compared field by field with the config, so that the error names the
config field behind a wrong shape or a missing tensor instead of listing tensors."""

from __future__ import annotations

import re

from jaxmtp.config import ModelConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")


def implied_sizes(shapes: dict[str, tuple[int, ...]]) -> dict[str, int | None]:
    """{config field: value} for the fields the HF tensors of a checkpoint determine. shapes: tensor
    name -> shape (FP8 weights have their dense shape; scales are ignored). A size is read from every
    tensor that shows it and kept only where they all agree, so that one wrongly shaped tensor is
    reported as such (by the tensor-by-tensor checks), not as a wrong size in config.json."""
    layers: dict[int, dict[str, tuple]] = {}
    for name, shape in shapes.items():
        match = _LAYER.fullmatch(name)
        if match:
            layers.setdefault(int(match[1]), {})[match[2]] = shape
    mtp = sorted(i for i, tensors in layers.items() if "eh_proj.weight" in tensors)
    main = [layers[i] for i in sorted(layers) if i not in mtp]
    dense = [t for t in main if "mlp.gate_proj.weight" in t]
    moe = [t for t in main if "mlp.gate.weight" in t]
    dim = lambda tensors, name, axis: tensors[name][axis] if name in tensors else None  # noqa: E731
    first = main[0] if main else {}
    sizes = {"num_hidden_layers": len(main), "num_nextn_predict_layers": len(mtp),
             "vocab_size": _agreed(dim(shapes, "model.embed_tokens.weight", 0), dim(shapes, "lm_head.weight", 0)),
             "hidden_size": _agreed(dim(shapes, "model.embed_tokens.weight", 1), dim(shapes, "lm_head.weight", 1),
                                    dim(shapes, "model.norm.weight", 0), dim(first, "input_layernorm.weight", 0)),
             "first_k_dense_replace": len(dense),
             "kv_lora_rank": _agreed(dim(first, "self_attn.kv_a_layernorm.weight", 0),
                                     dim(first, "self_attn.kv_b_proj.weight", 1))}
    if dense:
        sizes["intermediate_size"] = _agreed(dim(dense[0], "mlp.gate_proj.weight", 0),
                                             dim(dense[0], "mlp.up_proj.weight", 0),
                                             dim(dense[0], "mlp.down_proj.weight", 1))
    if moe:
        sizes["n_routed_experts"] = _agreed(dim(moe[0], "mlp.gate.weight", 0),
                                            dim(moe[0], "mlp.gate.e_score_correction_bias", 0))
        experts = {int(m[1]) for m in map(_EXPERT.match, moe[0]) if m}
        sizes["stored_experts"] = max(experts) + 1 if experts else 0
        sizes["moe_intermediate_size"] = _agreed(dim(moe[0], "mlp.experts.0.gate_proj.weight", 0),
                                                 dim(moe[0], "mlp.experts.0.up_proj.weight", 0))
    return {field: value for field, value in sizes.items() if value is not None}


def _agreed(*values):
    """The one value all the non-None `values` share, else None (no tensor shows it, or they differ)."""
    seen = {v for v in values if v is not None}
    return seen.pop() if len(seen) == 1 else None


def mismatch(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The first config field that the checkpoint's tensors contradict, as a sentence, or None."""
    found = implied_sizes(shapes)
    if found["num_hidden_layers"] == 0:
        return None  # not the HF layer layout: the tensor-by-tensor checks report it
    wanted = {field: getattr(config, field) for field in found if field != "stored_experts"}
    if config.num_moe_layers == 0:  # routed-expert sizes of a config without MoE layers are unused
        for field in ("n_routed_experts", "moe_intermediate_size"):
            wanted.pop(field, None)
    for field, value in wanted.items():
        if field == "num_nextn_predict_layers":  # MTP tensors beside a config without them are reported one by one
            if value > found[field]:
                return (f"num_nextn_predict_layers = {value} in config.json promises an MTP layer, but the "
                        f"checkpoint has none (no model.layers.{config.num_hidden_layers}.eh_proj.weight); load the "
                        "main model alone with jaxmtp.load(path, mtp=False)")
        elif value != found[field]:
            return f"{field} = {value} in config.json, but the checkpoint's tensors have {found[field]}"
    if "stored_experts" in found and found["stored_experts"] != config.n_routed_experts and config.num_moe_layers:
        return (f"n_routed_experts = {config.n_routed_experts} in config.json, but the checkpoint has "
                f"{found['stored_experts']} experts per MoE layer")
    return None

"""DeepSeek-V4 tensor names: transformers' (`DeepseekV4ForCausalLM` state dicts; what its
`save_pretrained` writes, `saved_hf_name`) and DeepSeek's released ones (`released_name`) to and from
jaxmtp's parameter paths, and which weights the release stores block-scaled (`quantizable`). jaxmtp
keeps one layout; names are mapped here, at load and save only (jaxmtp.models.deepseek_v4.checkpoint).

jaxmtp's tree follows DeepSeek's module nesting where transformers' differs: the indexer is a
sibling of the compressor (`self_attn/indexer/compressor/...`, DeepSeek's `attn.indexer.compressor`)
rather than inside it, its scorer's `weights_proj` sits in the indexer, and the routed experts'
gate and up projections are separate [E, I, D] arrays (transformers joins them as `gate_up_proj`).
"""

import re

import numpy as np

from jaxmtp.errors import CheckpointError
from jaxmtp.models.deepseek_v4.config import V4Config
from jaxmtp.models.deepseek_v4.transformer import stack_layers

_RULES = [
    (r"model\.embed_tokens\.weight", "embed_tokens/weight"),
    (r"lm_head\.weight", "lm_head/weight"),
    (r"model\.norm\.weight", "norm/weight"),
    (r"model\.hc_head\.(hc_fn|hc_base|hc_scale)", r"hc_head/\1"),
    (r"model\.layers\.(\d+)\.(attn_hc|ffn_hc)\.(fn|base|scale)", r"layers_\1/\2/\3"),
    (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers_\1/\2/weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(q_a_proj|q_a_norm|q_b_proj|kv_proj|kv_norm|o_a_proj|o_b_proj)\.weight",
     r"layers_\1/self_attn/\2/weight"),
    (r"model\.layers\.(\d+)\.self_attn\.sinks", r"layers_\1/self_attn/sinks"),
    (r"model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.(kv_proj|gate_proj|kv_norm)\.weight",
     r"layers_\1/self_attn/indexer/compressor/\2/weight"),
    (r"model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.position_bias",
     r"layers_\1/self_attn/indexer/compressor/position_bias"),
    (r"model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.q_b_proj\.weight",
     r"layers_\1/self_attn/indexer/q_b_proj/weight"),
    (r"model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight",
     r"layers_\1/self_attn/indexer/weights_proj/weight"),
    (r"model\.layers\.(\d+)\.self_attn\.compressor\.(kv_proj|gate_proj|kv_norm)\.weight",
     r"layers_\1/self_attn/compressor/\2/weight"),
    (r"model\.layers\.(\d+)\.self_attn\.compressor\.position_bias", r"layers_\1/self_attn/compressor/position_bias"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.(weight|e_score_correction_bias|tid2eid)", r"layers_\1/mlp/gate/\2"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", r"layers_\1/mlp/experts/down_proj"),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight",
     r"layers_\1/mlp/shared_experts/\2/weight"),
]
_JOINT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj")


def params_from_hf(config: V4Config, state: dict[str, np.ndarray], dtype=np.float32) -> dict:
    """transformers' state dict (name -> array) -> jaxmtp's nested parameter dict (layers stacked in
    segments, transformer.stack_layers). Floating arrays are
    cast to `dtype` except those kept in float32 (hyper-connections, sinks, position biases, the
    routing bias); the token -> experts table becomes int32. Unknown names raise CheckpointError."""
    params: dict = {}
    for name, value in state.items():
        value = np.asarray(value)
        joint = _JOINT.fullmatch(name)
        if joint:
            gate, up = np.split(value, 2, axis=1)
            base = f"layers_{joint.group(1)}/mlp/experts"
            _put(params, f"{base}/gate_proj", _cast(f"{base}/gate_proj", gate, dtype))
            _put(params, f"{base}/up_proj", _cast(f"{base}/up_proj", up, dtype))
            continue
        for pattern, target in _RULES:
            if re.fullmatch(pattern, name):
                path = re.sub(pattern, target, name)
                _put(params, path, _cast(path, value, dtype))
                break
        else:
            raise CheckpointError(f"{name}: not a DeepSeek-V4 tensor name jaxmtp knows")
    return stack_layers(config, params)


_FLOAT32 = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias")


def _cast(path: str, value: np.ndarray, dtype):
    if path.endswith("tid2eid"):
        return value.astype(np.int32)
    if any(part in path.split("/") for part in _FLOAT32):
        return value.astype(np.float32)
    return value.astype(dtype)


def _put(tree: dict, path: str, value):
    *parents, leaf = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


# ----- every checkpoint tensor of a parameter tree, in each layout -----------------------------
# DeepSeek's released layout (`embed.weight`, `layers.{i}.attn.wq_a.weight`, `mtp.0.e_proj.weight`, ...):
# jaxmtp path -> name. Per-layer names are relative to `layers.{i}.` (main model) or `mtp.0.` (the MTP
# block's decoder layer); `{e}` is a routed expert's index (one tensor per expert in the files).
_RELEASED_TOP = {
    "embed_tokens/weight": "embed.weight", "lm_head/weight": "head.weight", "norm/weight": "norm.weight",
    "hc_head/hc_fn": "hc_head_fn", "hc_head/hc_base": "hc_head_base", "hc_head/hc_scale": "hc_head_scale",
}
_RELEASED_MTP = {  # under mtp/, besides the block
    "e_proj/weight": "e_proj.weight", "h_proj/weight": "h_proj.weight", "enorm/weight": "enorm.weight",
    "hnorm/weight": "hnorm.weight", "norm/weight": "norm.weight", "hc_head/hc_fn": "hc_head_fn",
    "hc_head/hc_base": "hc_head_base", "hc_head/hc_scale": "hc_head_scale",
}
_POOL = {"kv_proj/weight": "wkv.weight", "gate_proj/weight": "wgate.weight", "kv_norm/weight": "norm.weight",
         "position_bias": "ape"}
_RELEASED_LAYER = {
    "input_layernorm/weight": "attn_norm.weight", "post_attention_layernorm/weight": "ffn_norm.weight",
    **{f"{ours}/{part}": f"{theirs}_{part}" for ours, theirs in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn"))
       for part in ("fn", "base", "scale")},
    "self_attn/q_a_proj/weight": "attn.wq_a.weight", "self_attn/q_a_norm/weight": "attn.q_norm.weight",
    "self_attn/q_b_proj/weight": "attn.wq_b.weight", "self_attn/kv_proj/weight": "attn.wkv.weight",
    "self_attn/kv_norm/weight": "attn.kv_norm.weight", "self_attn/o_a_proj/weight": "attn.wo_a.weight",
    "self_attn/o_b_proj/weight": "attn.wo_b.weight", "self_attn/sinks": "attn.attn_sink",
    **{f"self_attn/compressor/{ours}": f"attn.compressor.{theirs}" for ours, theirs in _POOL.items()},
    **{f"self_attn/indexer/compressor/{ours}": f"attn.indexer.compressor.{theirs}" for ours, theirs in _POOL.items()},
    "self_attn/indexer/q_b_proj/weight": "attn.indexer.wq_b.weight",
    "self_attn/indexer/weights_proj/weight": "attn.indexer.weights_proj.weight",
    "mlp/gate/weight": "ffn.gate.weight", "mlp/gate/e_score_correction_bias": "ffn.gate.bias",
    "mlp/gate/tid2eid": "ffn.gate.tid2eid",
    "mlp/shared_experts/gate_proj/weight": "ffn.shared_experts.w1.weight",
    "mlp/shared_experts/down_proj/weight": "ffn.shared_experts.w2.weight",
    "mlp/shared_experts/up_proj/weight": "ffn.shared_experts.w3.weight",
    "mlp/experts/gate_proj": "ffn.experts.{e}.w1.weight", "mlp/experts/down_proj": "ffn.experts.{e}.w2.weight",
    "mlp/experts/up_proj": "ffn.experts.{e}.w3.weight",
}
# The weights the release stores block-scaled (`.scale` beside `.weight`): FP8 linears, 128x128 blocks; the
# routed experts FP4 (instruct releases) or FP8 (base releases). Everything else ships bf16 / f32 / int64.
FP8_WEIGHTS = frozenset({"self_attn/q_a_proj/weight", "self_attn/q_b_proj/weight", "self_attn/kv_proj/weight",
                         "self_attn/o_a_proj/weight", "self_attn/o_b_proj/weight", "self_attn/indexer/q_b_proj/weight",
                         "mlp/shared_experts/gate_proj/weight", "mlp/shared_experts/up_proj/weight",
                         "mlp/shared_experts/down_proj/weight", "e_proj/weight", "h_proj/weight"})
EXPERT_WEIGHTS = frozenset({"mlp/experts/gate_proj", "mlp/experts/up_proj", "mlp/experts/down_proj"})

# transformers' state-dict names (`DeepseekV4ForCausalLM.state_dict()`), the inverse of _RULES; the routed
# experts' gate and up projections are one `gate_up_proj` [E, 2I, D] there (the path `mlp/experts/gate_up_proj`
# below stands for the pair).
_HF_TOP = {"embed_tokens/weight": "model.embed_tokens.weight", "lm_head/weight": "lm_head.weight",
           "norm/weight": "model.norm.weight", "hc_head/hc_fn": "model.hc_head.hc_fn",
           "hc_head/hc_base": "model.hc_head.hc_base", "hc_head/hc_scale": "model.hc_head.hc_scale"}
_HF_POOL = {"kv_proj/weight": "kv_proj.weight", "gate_proj/weight": "gate_proj.weight",
            "kv_norm/weight": "kv_norm.weight", "position_bias": "position_bias"}
_HF_LAYER = {
    **{f"{hc}/{part}": f"{hc}.{part}" for hc in ("attn_hc", "ffn_hc") for part in ("fn", "base", "scale")},
    "input_layernorm/weight": "input_layernorm.weight",
    "post_attention_layernorm/weight": "post_attention_layernorm.weight",
    **{f"self_attn/{m}/weight": f"self_attn.{m}.weight"
       for m in ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj")},
    "self_attn/sinks": "self_attn.sinks",
    **{f"self_attn/compressor/{ours}": f"self_attn.compressor.{theirs}" for ours, theirs in _HF_POOL.items()},
    **{f"self_attn/indexer/compressor/{ours}": f"self_attn.compressor.indexer.{theirs}"
       for ours, theirs in _HF_POOL.items()},
    "self_attn/indexer/q_b_proj/weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "self_attn/indexer/weights_proj/weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "mlp/gate/weight": "mlp.gate.weight", "mlp/gate/e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "mlp/gate/tid2eid": "mlp.gate.tid2eid",
    **{f"mlp/shared_experts/{m}/weight": f"mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")},
    "mlp/experts/gate_up_proj": "mlp.experts.gate_up_proj", "mlp/experts/down_proj": "mlp.experts.down_proj",
}
JOINT_EXPERTS = "mlp/experts/gate_up_proj"


def split_path(path) -> tuple[str, str, str]:
    """A parameter path (tuple or "a/b/c") -> (part, layer, rest): part "top", "layer" (layer = its
    index), "mtp" (rest under mtp/, besides the block) or "mtp_block" (rest under mtp/block/)."""
    keys = path.split("/") if isinstance(path, str) else list(path)
    if keys[0].startswith("layers_"):
        return "layer", keys[0].removeprefix("layers_"), "/".join(keys[1:])
    if keys[0] == "mtp":
        if keys[1] == "block":
            return "mtp_block", "", "/".join(keys[2:])
        return "mtp", "", "/".join(keys[1:])
    return "top", "", "/".join(keys)


def released_name(path, expert: int | None = None) -> str:
    """DeepSeek's released name of the parameter at `path` (of routed expert `expert` for the stacked
    expert weights): `layers_3/self_attn/q_a_proj/weight` -> `layers.3.attn.wq_a.weight`,
    `mtp/block/mlp/experts/up_proj`, 5 -> `mtp.0.ffn.experts.5.w3.weight`, `mtp/e_proj/weight` ->
    `mtp.0.e_proj.weight`. CheckpointError for a path the release has no name for."""
    part, layer, rest = split_path(path)
    table, prefix = {"top": (_RELEASED_TOP, ""), "layer": (_RELEASED_LAYER, f"layers.{layer}."),
                     "mtp": (_RELEASED_MTP, "mtp.0."), "mtp_block": (_RELEASED_LAYER, "mtp.0.")}[part]
    if rest not in table:
        raise CheckpointError(f"parameter {path if isinstance(path, str) else '/'.join(path)}: no name for it in "
                              "DeepSeek's released layout")
    name = prefix + table[rest]
    return name.format(e=expert) if "{e}" in name else name


def hf_name(path) -> str:
    """transformers' state-dict name of the parameter at `path` (mlp/experts/gate_up_proj: the joint
    gate and up projections). The MTP block has none (transformers has no MTP module): CheckpointError."""
    part, layer, rest = split_path(path)
    if part == "top" and rest in _HF_TOP:
        return _HF_TOP[rest]
    if part == "layer" and rest in _HF_LAYER:
        return f"model.layers.{layer}.{_HF_LAYER[rest]}"
    raise CheckpointError(f"parameter {path if isinstance(path, str) else '/'.join(path)}: no name for it in "
                          "transformers' DeepseekV4ForCausalLM")


def saved_hf_name(released: str) -> str:
    """The name transformers' `save_pretrained` (5.x) writes for a main-model tensor, from its released
    name: it reverses its load-time renames only partly, so the files hold DeepSeek's module names under
    `model.` (`model.layers.0.attn.wq_a.weight`, `model.layers.0.ffn.experts.3.w1.weight`), with
    `model.embed_tokens.weight`, `head.weight`, `model.norm.weight`, `model.hc_head.hc_fn` and the
    attention's kv_norm as `attn.norm`."""
    special = {"embed.weight": "model.embed_tokens.weight", "head.weight": "head.weight",
               **{f"hc_head_{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")}}
    if released in special:
        return special[released]
    return "model." + re.sub(r"^(layers\.\d+\.attn)\.kv_norm\.", r"\1.norm.", released)


def quantizable(path) -> tuple[str, ...]:
    """The block-scaled forms the release may store the parameter at `path` in: ("fp8",) for the FP8
    linears, ("fp4", "fp8") for the routed experts, () for the rest."""
    _, _, rest = split_path(path)
    if rest in EXPERT_WEIGHTS:
        return ("fp4", "fp8")
    return ("fp8",) if rest in FP8_WEIGHTS else ()

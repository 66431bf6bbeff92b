"""DeepSeek-V4 tensor names: transformers' (`DeepseekV4ForCausalLM` state dicts, `save_pretrained`)
to jaxmtp's parameter paths. jaxmtp keeps one layout; names are mapped here, at load and save only.

jaxmtp's tree follows DeepSeek's module nesting where transformers' differs: the indexer is a
sibling of the compressor (`self_attn/indexer/compressor/...`, DeepSeek's `attn.indexer.compressor`)
rather than inside it, its scorer's `weights_proj` sits in the indexer, and the routed experts'
gate and up projections are separate [E, I, D] arrays (transformers joins them as `gate_up_proj`).
"""

import re

import numpy as np

from jaxmtp.errors import CheckpointError
from jaxmtp.models.deepseek_v4.config import V4Config

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
    """transformers' state dict (name -> array) -> jaxmtp's nested parameter dict. Floating arrays are
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
    return params


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

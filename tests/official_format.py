"""Writes DeepSeek's converted `model{rank}-mp{n}.safetensors` checkpoints from an HF-layout directory
the way DeepSeek-V3's inference/convert.py does: its rename table and string replacements, its
tensor-parallel cuts, routed experts handed whole to ranks, and the MTP layer skipped."""

import glob
import os
import shutil

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import jaxmtp.checkpoint.hf  # noqa: F401  (registers the FP8 numpy dtypes safetensors looks up)

# convert.py's table: HF module -> (converted module, dim cut across ranks).
MAPPING = {
    "embed_tokens": ("embed", 0), "input_layernorm": ("attn_norm", None),
    "post_attention_layernorm": ("ffn_norm", None), "q_proj": ("wq", 0), "q_a_proj": ("wq_a", None),
    "q_a_layernorm": ("q_norm", None), "q_b_proj": ("wq_b", 0), "kv_a_proj_with_mqa": ("wkv_a", None),
    "kv_a_layernorm": ("kv_norm", None), "kv_b_proj": ("wkv_b", 0), "o_proj": ("wo", 1), "gate": ("gate", None),
    "gate_proj": ("w1", 0), "down_proj": ("w2", 1), "up_proj": ("w3", 0), "norm": ("norm", None),
    "lm_head": ("head", 0), "scale": ("scale", None),
}


def convert(hf_dir: str, out_dir: str, n_experts: int, mp: int, mtp_layer: int):
    """mtp_layer: the HF layer index of the MTP module (61 for DeepSeek-V3), which is skipped."""
    n_local = n_experts // mp
    state = [{} for _ in range(mp)]
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                if f"model.layers.{mtp_layer}." in name:
                    continue
                param = f.get_tensor(name)
                if name.startswith("model."):
                    name = name[len("model."):]
                name = name.replace("self_attn", "attn").replace("mlp", "ffn")
                name = name.replace("weight_scale_inv", "scale").replace("e_score_correction_bias", "bias")
                key = name.split(".")[-2]
                new_key, dim = MAPPING[key]
                name = name.replace(key, new_key)
                for i in range(mp):
                    if "experts" in name and "shared_experts" not in name:
                        idx = int(name.split(".")[-3])
                        if not i * n_local <= idx < (i + 1) * n_local:
                            continue
                        state[i][name] = param
                    elif dim is not None:
                        assert param.shape[dim] % mp == 0, (name, param.shape, dim, mp)
                        size = param.shape[dim] // mp
                        state[i][name] = np.ascontiguousarray(np.take(param, range(i * size, (i + 1) * size), axis=dim))
                    else:
                        state[i][name] = param
    os.makedirs(out_dir, exist_ok=True)
    for i in range(mp):
        save_file(state[i], os.path.join(out_dir, f"model{i}-mp{mp}.safetensors"))
    shutil.copy(os.path.join(hf_dir, "config.json"), out_dir)  # jaxmtp reads the HF config beside the ranks
    return out_dir

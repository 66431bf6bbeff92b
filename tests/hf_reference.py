"""Builds tiny random HF `transformers` DeepSeek-V3 models (the independent reference) and saves
them, with their MTP layer, in the HF checkpoint layout that jaxmtp loads."""

import os

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM
from transformers.modeling_layers import MtpModel

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
            topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=10,
            first_k_dense_replace=2, max_position_embeddings=256, routed_scaling_factor=2.5, norm_topk_prob=True,
            num_nextn_predict_layers=1, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# Each covers a different corner; together: YaRN with max_position_embeddings > original, n_group > 1
# with topk_group < n_group, q_lora_rank null, several dense + MoE layers, norm_topk_prob both ways.
CONFIGS = {
    "yarn_groups": dict(BASE, rope_parameters=YARN),
    "no_q_lora": dict(BASE, q_lora_rank=None, norm_topk_prob=False, first_k_dense_replace=1, n_group=1, topk_group=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "yarn_attention_factor": dict(BASE, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                                  first_k_dense_replace=0, num_hidden_layers=3, rope_interleave=False,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                   "original_max_position_embeddings": 32}),
    "tied_two_shared": dict(BASE, tie_word_embeddings=True, n_shared_experts=2, first_k_dense_replace=3,
                            num_hidden_layers=5, norm_topk_prob=False, rope_parameters=YARN),
}


# DeepSeek-V3.2 (lightning indexer + top-k sparse attention): index_topk far below the test prompts'
# lengths, so that the selection decides which keys every pass attends to; 12-16 indexer heads, so
# that ties at the k-th score (keys whose every head's dot product is negative score exactly 0)
# are rare. Corners: YaRN with groups; the default RoPE with one group; YaRN's attention_factor
# with more experts and no dense layer.
V32_CONFIGS = {
    "v32_yarn_groups": dict(BASE, rope_parameters=YARN, index_n_heads=16, index_head_dim=16, index_topk=6),
    "v32_default_rope": dict(BASE, norm_topk_prob=False, first_k_dense_replace=1, n_group=1, topk_group=1,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                             index_n_heads=12, index_head_dim=32, index_topk=11),
    "v32_attention_factor": dict(BASE, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                                 first_k_dense_replace=0, num_hidden_layers=3, index_n_heads=16, index_head_dim=8,
                                 index_topk=3, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                "factor": 8.0, "original_max_position_embeddings": 32}),
}


def randomize(module: torch.nn.Module, seed: int):
    """Replaces HF's tiny init with O(1)-scale random weights so every path matters numerically;
    norms near 1 and a routing bias large enough to change which experts and groups win."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * noise)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))


def build(name: str, seed: int = 0):
    """-> (HF main model, HF MtpModel or None), float32, eval mode, random weights. Names from
    CONFIGS build DeepseekV3ForCausalLM, from V32_CONFIGS DeepseekV32ForCausalLM."""
    torch.manual_seed(seed)
    if name in V32_CONFIGS:
        config = DeepseekV32Config(**V32_CONFIGS[name])
        # HF's V3.2 config names no MTP layer; these let the generic MtpModel build one of its layers.
        config.num_mtp_layers, config.mtp_layer_types, config.mtp_mlp_layer_types = 1, ["full_attention"], ["sparse"]
        model_class = DeepseekV32ForCausalLM
    else:
        config, model_class = DeepseekV3Config(**CONFIGS[name]), DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    main = model_class(config).eval()
    randomize(main, seed)
    mtp = None
    if config.num_nextn_predict_layers:
        mtp = MtpModel(main, config.num_nextn_predict_layers).eval()
        randomize(mtp.layers, seed + 1)
    return main, mtp


def mtp_state_dict(mtp: MtpModel, main: DeepseekV3ForCausalLM) -> dict:
    """The MTP module's tensors under DeepSeek-V3 checkpoint names (layer index = num_hidden_layers),
    experts split per expert, plus the embedding/head copies the published checkpoint carries."""
    n = main.config.num_hidden_layers
    out = {}
    for key, value in mtp.layers[0].state_dict().items():
        key = key.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if key.endswith("experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"model.layers.{n}.mlp.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"model.layers.{n}.mlp.experts.{e}.up_proj.weight"] = up[e]
        elif key.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[f"model.layers.{n}.{key}"] = value
    out[f"model.layers.{n}.embed_tokens.weight"] = main.model.embed_tokens.weight
    out[f"model.layers.{n}.shared_head.head.weight"] = main.lm_head.weight
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save(main, mtp, directory: str):
    """save_pretrained for the main model, then the MTP layer in a file of its own beside it."""
    main.save_pretrained(directory)
    if mtp is not None:
        save_file(mtp_state_dict(mtp, main), os.path.join(directory, "model-mtp.safetensors"))
    return directory


def mtp_logits(mtp: MtpModel, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """HF's MTP layer, teacher-forced over every position: slot p sees hidden[:, p] and t_{p+1}."""
    batch, length = next_tokens.shape
    positions = torch.arange(length)[None].expand(batch, length)
    z = mtp.forward_layer(0, hidden, positions, None, input_ids=next_tokens)
    return mtp._project_to_logits(z)


# Dimensions around 128 so that FP8 128x128 blocks include partial tiles (kv_a: 136 rows -> 2 scale
# rows; in-dims 160 and 200 are not multiples of 128).
FP8_CONFIG = dict(BASE, hidden_size=160, intermediate_size=200, moe_intermediate_size=136, num_attention_heads=2,
                  num_key_value_heads=2, q_lora_rank=144, kv_lora_rank=128, qk_rope_head_dim=8, qk_nope_head_dim=16,
                  v_head_dim=16, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                  num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0, rope_parameters=YARN)
FP8_SUFFIXES = tuple(f"{m}.weight" for m in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                             "o_proj", "gate_proj", "up_proj", "down_proj", "indexer.wq_b",
                                             "indexer.wk"))


def quantize_blocks(w: np.ndarray, block: int = 128):
    """DeepSeek-V3's FP8 format: per 128x128 block (zero-padded at the edges) scale = amax / 448,
    value = w / scale in float8_e4m3fn. Returns (value, scale [ceil(out/128), ceil(in/128)])."""
    import ml_dtypes

    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = np.ones((rows, cols), np.float32)
    value = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = max(np.abs(tile).max() / 448.0, 1e-12)
            value[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).astype(value.dtype)
    return value, scale


def dequantize_blocks(value: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """W[i, j] = float32(value[i, j]) * scale[i // 128, j // 128]."""
    i = np.arange(value.shape[0]) // block
    j = np.arange(value.shape[1]) // block
    return value.astype(np.float32) * scale[i][:, j]


def save_fp8(main, mtp, directory: str):
    """A DeepSeek-V3-style FP8 checkpoint of the model: projections as e4m3fn + weight_scale_inv.
    Returns the dequantized tensors {name: float32 array} that the checkpoint really holds."""
    import json

    from safetensors.numpy import load_file, save_file as save_numpy

    save(main, mtp, directory)
    dequantized = {}
    for file in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        path = os.path.join(directory, file)
        tensors = load_file(path)
        out = {}
        for name, w in tensors.items():
            if name.endswith(FP8_SUFFIXES):
                value, scale = quantize_blocks(w)
                out[name], out[name + "_scale_inv"] = value, scale
                dequantized[name] = dequantize_blocks(value, scale)
            else:
                out[name] = w
                dequantized[name] = w
        save_numpy(out, path)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return dequantized

# FP8 with every tensor-parallel cut a whole number of 128-blocks per rank at mp=2 (wq_b/wkv_b 512
# rows, wo 256 columns, MLP 256), as DeepSeek's converter requires; hidden 160 keeps partial tiles.
FP8_TP_CONFIG = dict(FP8_CONFIG, num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=64,
                     qk_rope_head_dim=64, v_head_dim=64, intermediate_size=256, moe_intermediate_size=256)

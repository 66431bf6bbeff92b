"""Reading, writing and validating HF config.json."""

import json

import pytest
from transformers import DeepseekV3Config

import jaxmtp
from jaxmtp import ConfigError, ModelConfig

V3_PATH = f"{jaxmtp.CONFIGS}/deepseek_v3_671b.json"


def v3_dict():
    with open(V3_PATH) as f:
        return json.load(f)


def test_reads_the_published_v3_config():
    cfg = ModelConfig.from_hf_config(V3_PATH)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_nextn_predict_layers) == (
        7168, 61, 256, 1)
    assert cfg.rope_scaling.factor == 40 and cfg.rope_scaling.original_max_position_embeddings == 4096
    assert cfg.quantization.weight_block_size == (128, 128)
    assert hash(cfg) == hash(ModelConfig.from_hf_config(v3_dict()))


def test_rope_scaling_and_rope_parameters_spellings_agree():
    legacy = v3_dict()
    modern = dict(legacy)
    scaling = dict(modern.pop("rope_scaling"))
    scaling["rope_type"] = scaling.pop("type")
    scaling["rope_theta"] = modern.pop("rope_theta")
    modern["rope_parameters"] = scaling
    assert ModelConfig.from_hf_config(legacy) == ModelConfig.from_hf_config(modern)


def test_round_trip_through_hf_config_and_transformers():
    cfg = ModelConfig.from_hf_config(V3_PATH)
    written = cfg.to_hf_config()
    assert ModelConfig.from_hf_config(written) == cfg
    # transformers itself accepts what we write and reads back the same architecture.
    hf = DeepseekV3Config(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert ModelConfig.from_hf_config(hf.to_dict()) == cfg


def test_q_lora_rank_null_and_no_mtp():
    raw = v3_dict() | {"q_lora_rank": None, "num_nextn_predict_layers": 0}
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.q_lora_rank is None and not cfg.has_mtp


@pytest.mark.parametrize("change, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_size": -8}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"topk_group": 9}, "topk_group"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"n_routed_experts": 250}, "n_group"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
    ({"first_k_dense_replace": 62}, "first_k_dense_replace"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
])
def test_bad_values_raise_config_error_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_config(v3_dict() | change)


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": "10"}, "num_hidden_layers: expected an integer, found '10'"),
    ({"hidden_size": 64.5}, "hidden_size: expected an integer, found 64.5"),
    ({"first_k_dense_replace": None}, "first_k_dense_replace: expected an integer, found None"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps: expected a number, found '1e-6'"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings: expected true or false, found 'yes'"),
    ({"eos_token_id": "x"}, "eos_token_id: expected an integer, found 'x'"),
    ({"eos_token_id": [1, 10 ** 9]}, r"eos_token_id: 1000000000 is outside the vocabulary \[0, 129280\)"),
    ({"rope_scaling": "yarn"}, "rope_scaling: expected a dict, found str"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "40", "original_max_position_embeddings": 4096}},
     "rope_parameters.factor: expected a number, found '40'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": "128"}},
     "quantization_config.weight_block_size: expected two positive ints"),
])
def test_wrong_types_raise_config_error_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(v3_dict() | change)


def test_config_file_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json: expected a JSON object of fields, found a JSON list"):
        ModelConfig.from_hf_config(tmp_path)


def test_missing_kv_lora_rank_raises():
    raw = v3_dict()
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank: required field is missing"):
        ModelConfig.from_hf_config(raw)


def test_config_errors_are_value_errors(tmp_path):
    assert issubclass(ConfigError, ValueError) and issubclass(jaxmtp.CheckpointError, ValueError)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf_config(tmp_path)

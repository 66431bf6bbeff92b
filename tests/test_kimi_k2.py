"""Kimi K2 (`model_type: kimi_k2`): the DeepSeek-V3 architecture with Moonshot's sizes and no MTP
weights. The published config loads and counts; a tiny kimi_k2 checkpoint written by HF
transformers' DeepseekV3ForCausalLM generates what transformers' own greedy generate does."""

import json

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import hf_reference as ref
import jaxmtp
from jaxmtp.cli import main as cli
from jaxmtp.errors import ConfigError
from jaxmtp.params import parameter_counts

KIMI_TINY = dict(ref.BASE, n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
                 num_nextn_predict_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def test_published_config_loads_and_counts_about_a_trillion():
    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/kimi_k2.json")
    assert config.model_type == "kimi_k2" and not config.has_mtp
    sizes = (config.n_routed_experts, config.num_attention_heads, config.n_group, config.vocab_size)
    assert sizes == (384, 64, 1, 163840)
    counts = parameter_counts(config)
    assert round(counts["main"] / 1e12, 2) == 1.03 and counts["mtp_unique"] == 0
    assert config.to_hf_config()["model_type"] == "kimi_k2"


def test_other_model_types_are_refused_with_the_supported_ones():
    raw = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json").to_hf_config()
    for model_type in ("deepseek_v2", "llama", None):
        with pytest.raises(ConfigError, match=r"model_type: expected one of 'deepseek_v3', 'kimi_k2', 'deepseek_v32' "
                                                r"\(the DeepSeek-V3 architecture: .*V3\.2.*\)"):
            jaxmtp.ModelConfig.from_hf_config(dict(raw, model_type=model_type))


@pytest.fixture(scope="module")
def kimi_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = DeepseekV3Config(**KIMI_TINY)
    config._attn_implementation = "eager"
    main = DeepseekV3ForCausalLM(config).eval()
    ref.randomize(main, 0)
    path = tmp_path_factory.mktemp("kimi")
    ref.save(main, None, str(path))
    raw = json.load(open(path / "config.json"))
    json.dump(dict(raw, model_type="kimi_k2"), open(path / "config.json", "w"))
    return main, path


def test_tiny_kimi_checkpoint_generates_what_transformers_generates(kimi_checkpoint, tmp_path):
    main, path = kimi_checkpoint
    model = jaxmtp.load(path, dtype="float32", quiet=True)
    assert model.config.model_type == "kimi_k2"
    prompt = [5, 17, 3, 60, 2, 9]
    with torch.no_grad():
        want = main.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert jaxmtp.generate(model, [prompt], max_new_tokens=8).tokens == [want]
    assert jaxmtp.generate(model, [prompt], max_new_tokens=8, speculative_k="auto").tokens == [want]
    with pytest.raises(ValueError, match="speculative_k > 0 needs an MTP module"):
        jaxmtp.generate(model, [prompt], max_new_tokens=8, speculative_k=2)
    jaxmtp.save(model, tmp_path / "saved")
    assert json.load(open(tmp_path / "saved" / "config.json"))["model_type"] == "kimi_k2"


def test_cli_says_what_a_kimi_checkpoint_needs(kimi_checkpoint, capsys, monkeypatch):
    """Kimi K2 ships tiktoken.model, not tokenizer.json: text prompts are refused with a pointer to
    --tokens, before any weight is read; token ids generate, with a note that there is no MTP layer
    to speculate with."""
    _, path = kimi_checkpoint
    (path / "tiktoken.model").write_text("")
    with monkeypatch.context() as patched, pytest.raises(SystemExit):
        patched.setattr(jaxmtp, "load", lambda *args, **kwargs: pytest.fail("loaded before refusing the prompt"))
        cli(["generate", "--model", str(path), "--quiet", "hello"])
    refused = capsys.readouterr().err
    assert "tiktoken tokenizer (tiktoken.model" in refused and "pass token ids with --tokens" in refused
    cli(["generate", "--model", str(path), "--quiet", "--tokens", "5,17,3", "--max-new-tokens", "4"])
    assert "speculation needs one" in capsys.readouterr().err

"""DeepSeek's converted model{rank}-mp{n} format loads to the same parameters as the HF layout."""

import os

import jax
import numpy as np
import pytest
import torch

import hf_reference as ref
import jaxmtp
import official_format
from jaxmtp import CheckpointError
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


def _assert_same(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    main, mtp = ref.build("yarn_groups", seed=4)
    return ref.save(main, mtp, str(tmp_path_factory.mktemp("hf")))


@pytest.mark.parametrize("mp", [2, 4])
def test_converted_equals_hf_layout(hf_dir, tmp_path, mp):
    converted = official_format.convert(hf_dir, str(tmp_path / "mp"), n_experts=8, mp=mp, mtp_layer=4)
    assert sorted(os.listdir(converted)) == sorted([f"model{r}-mp{mp}.safetensors" for r in range(mp)] + ["config.json"])
    expected = jaxmtp.load(hf_dir, quiet=True)
    with pytest.warns(UserWarning, match="carries no MTP layer"):
        got = jaxmtp.load(converted, quiet=True)
    assert not got.config.has_mtp and "mtp" not in got.params
    _assert_same(got.params, expected.without_mtp().params)


def test_converted_fp8_equals_hf_layout(tmp_path):
    torch.manual_seed(0)
    config = DeepseekV3Config(**ref.FP8_TP_CONFIG)
    main = DeepseekV3ForCausalLM(config).eval()
    ref.randomize(main, 9)
    hf = str(tmp_path / "hf")
    ref.save_fp8(main, None, hf)
    converted = official_format.convert(hf, str(tmp_path / "mp"), n_experts=4, mp=2, mtp_layer=2)
    for quantized in ("keep", "dequantize"):
        expected = jaxmtp.load(hf, quantized=quantized, quiet=True)
        got = jaxmtp.load(converted, quantized=quantized, quiet=True)
        _assert_same(got.params, expected.params)


def test_missing_rank_file(hf_dir, tmp_path):
    converted = official_format.convert(hf_dir, str(tmp_path / "mp"), n_experts=8, mp=4, mtp_layer=4)
    os.remove(os.path.join(converted, "model2-mp4.safetensors"))
    with pytest.raises(CheckpointError, match=r"rank file\(s\) \['model2-mp4\.safetensors'\] of an mp=4 checkpoint"):
        jaxmtp.load(converted, quiet=True)

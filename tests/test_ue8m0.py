"""DeepSeek-V3.1's FP8 scale format: quantization_config.scale_fmt "ue8m0" makes the activation
scales powers of two (DeepSeek's `act_quant` with `scale_fmt`: max(amax, 1e-4) x (1 / 448), its
exponent rounded up); weight scales are used as stored."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import generation_models as gm
from deepseek_reference import numpy_ue8m0_act_quant
import jaxmtp
from jaxmtp.config import QuantizationConfig
from jaxmtp.errors import ConfigError
from jaxmtp.quant import QuantizedWeight, linear, quantize_params
from pallas_kernels import act_quant, act_quant_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(5, 320), (2, 3, 128), (1, 7)])
def test_ue8m0_activation_quantization_is_bit_exact(dtype, shape):
    rng = np.random.default_rng(0)
    x = rng.normal(scale=3.0, size=shape) * rng.choice([1e-6, 1e-2, 1.0, 300.0], size=shape[:-1] + (1,))
    x = jnp.asarray(x, dtype)
    want_q, want_s = numpy_ue8m0_act_quant(np.asarray(x, np.float32))
    for q, s in (act_quant(x, round_scale=True, interpret=True), act_quant_reference(x, round_scale=True)):
        np.testing.assert_array_equal(np.asarray(s), want_s)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    assert np.all(np.log2(want_s) == np.round(np.log2(want_s)))  # powers of two


def _v31_config(config):
    raw = config.to_hf_config()
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    return raw


def test_scale_format_is_read_kept_and_refused_when_unknown():
    raw = _v31_config(gm.TINY)
    config = jaxmtp.ModelConfig.from_hf_config(raw)
    assert config.quantization.scale_fmt == "ue8m0"
    assert config.to_hf_config()["quantization_config"]["scale_fmt"] == "ue8m0"
    raw["quantization_config"]["scale_fmt"] = "e8m0"
    with pytest.raises(ConfigError, match="quantization_config.scale_fmt: expected one of .*'e8m0'"):
        jaxmtp.ModelConfig.from_hf_config(raw)


@pytest.fixture(scope="module")
def v31_checkpoint(tmp_path_factory):
    """A tiny FP8 checkpoint in the V3.1 format: ue8m0 activation scales, weight scales as they
    come from block quantization (not powers of two)."""
    base = gm.model("partial")
    config = jaxmtp.ModelConfig.from_hf_config(_v31_config(base.config))
    path = tmp_path_factory.mktemp("v31")
    params = quantize_params(base.params)
    jaxmtp.save(jaxmtp.Model(config, params), path)
    return path, params


def test_v31_checkpoint_loads_and_generates_with_both_matmuls(v31_checkpoint):
    path, saved = v31_checkpoint
    assert json.load(open(path / "config.json"))["quantization_config"]["scale_fmt"] == "ue8m0"
    prompts = [[3, 4, 5, 6], [7, 8]]
    models = {m: jaxmtp.load(path, dtype="float32", quantized="keep", matmul=m, quiet=True) for m in ("fp8", "dequant")}
    weight = models["fp8"].params["moe_layers"]["layers"]["mlp"]["experts"]["up_proj"]
    assert isinstance(weight, QuantizedWeight) and weight.matmul == "fp8" and weight.scale_fmt == "ue8m0"
    stored = saved["moe_layers"]["layers"]["mlp"]["experts"]["up_proj"].scale
    np.testing.assert_array_equal(np.asarray(weight.scale), stored)  # used as stored ...
    assert not np.all(np.log2(stored) == np.round(np.log2(stored)))  # ... and not powers of two
    # Speculative decoding with the W8A8 kernels is tests/test_fp8_model.py's: their rounding of the
    # k + 1 verify rows' activations keeps it from equalling plain decoding in every row.
    assert [len(row) for row in jaxmtp.generate(models["fp8"], prompts, max_new_tokens=6).tokens] == [6, 6]
    plain = jaxmtp.generate(models["dequant"], prompts, max_new_tokens=6).tokens
    assert jaxmtp.generate(models["dequant"], prompts, max_new_tokens=6, speculative_k=2).tokens == plain
    # The kernels quantize the activations with the rounded scales: one layer's product equals
    # float64 numpy over DeepSeek's formula, and the model's logits differ from amax / 448 scales'.
    w = weight.replace(value=weight.value[0, 0], scale=weight.scale[0, 0])  # layer 0, expert 0: [I, D]
    x = np.random.default_rng(1).normal(size=(4, w.shape[1])).astype(np.float32)
    q, scales = numpy_ue8m0_act_quant(x)
    columns = np.arange(x.shape[1]) // 128
    a = q.astype(np.float64) * scales[:, columns]
    b = np.asarray(w.value).astype(np.float64) * np.asarray(w.scale)[np.arange(w.shape[0]) // 128][:, columns]
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), w)), a @ b.T, rtol=1e-5, atol=1e-5)
    tokens = np.array([[3, 4, 5, 6, 9, 10, 11, 12]])
    fp8 = models["fp8"]
    unrounded = jaxmtp.Model(fp8.config.replace(quantization=QuantizationConfig()), fp8.params).with_matmul("fp8")
    assert not np.array_equal(np.asarray(fp8.forward(tokens)[0]), np.asarray(unrounded.forward(tokens)[0]))

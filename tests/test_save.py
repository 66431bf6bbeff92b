"""Round trips: jaxmtp -> HF layout -> transformers / jaxmtp, and jaxmtp -> orbax -> jaxmtp."""

import jax
import numpy as np
import torch
from transformers import DeepseekV3ForCausalLM

import hf_reference as ref
import jaxmtp
from jaxmtp.params import abstract_params


def _assert_bit_exact(a, b):
    leaves_a, tree_a = jax.tree.flatten(a.params)
    leaves_b, tree_b = jax.tree.flatten(b.params)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _cast(model, dtype):
    """The model's parameters in `dtype`, the routing bias staying float32 as the model keeps it."""
    target = abstract_params(model.config, dtype)
    return jaxmtp.Model(model.config, jax.tree.map(lambda x, t: x.astype(t.dtype), model.params, target))


def test_hf_round_trip_to_transformers_and_back(tmp_path):
    model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(ref.CONFIGS["yarn_groups"] | {
        "model_type": "deepseek_v3", "num_key_value_heads": 4}), seed=4)
    jaxmtp.save(model, tmp_path / "hf", format="hf")
    again = jaxmtp.load(tmp_path / "hf", quiet=True)
    _assert_bit_exact(model, again)
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.forward(tokens)[0]), expected, rtol=0, atol=1e-4)


def test_orbax_round_trip_is_bit_exact(tmp_path):
    model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json"), seed=2, dtype="bfloat16")
    jaxmtp.save(model, tmp_path / "orbax", format="orbax")
    _assert_bit_exact(model, jaxmtp.load(tmp_path / "orbax"))


def test_orbax_restores_into_requested_dtype(tmp_path):
    model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json"), seed=3, dtype="float32")
    jaxmtp.save(model, tmp_path / "orbax", format="orbax")
    restored = jaxmtp.load(tmp_path / "orbax", dtype="bfloat16")
    _assert_bit_exact(_cast(model, "bfloat16"), restored)


def test_convert_cli_hf_to_orbax_and_back(tmp_path):
    from jaxmtp.cli import main

    model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json"), seed=5, dtype="bfloat16")
    jaxmtp.save(model, tmp_path / "hf", format="hf")
    main(["convert", str(tmp_path / "hf"), str(tmp_path / "orbax"), "--format", "orbax"])
    main(["convert", str(tmp_path / "orbax"), str(tmp_path / "hf32"), "--format", "hf", "--dtype", "float32"])
    _assert_bit_exact(model, jaxmtp.load(tmp_path / "orbax"))
    again = jaxmtp.load(tmp_path / "hf32", quiet=True)
    assert again.dtype == np.float32
    _assert_bit_exact(model, _cast(again, "bfloat16"))


def test_fp8_kept_round_trips_through_hf_and_orbax(tmp_path):
    torch.manual_seed(0)
    from transformers import DeepseekV3Config

    main = DeepseekV3ForCausalLM(DeepseekV3Config(**ref.FP8_CONFIG)).eval()
    ref.randomize(main, 1)
    ref.save_fp8(main, None, str(tmp_path / "src"))
    kept = jaxmtp.load(tmp_path / "src", dtype="float32", quantized="keep", quiet=True)
    jaxmtp.save(kept, tmp_path / "hf", format="hf")
    _assert_bit_exact(kept, jaxmtp.load(tmp_path / "hf", quantized="keep", quiet=True))
    jaxmtp.save(kept, tmp_path / "orbax", format="orbax")
    _assert_bit_exact(kept, jaxmtp.load(tmp_path / "orbax", quantized="keep"))
    dense = jaxmtp.load(tmp_path / "src", dtype="float32", quantized="dequantize", quiet=True)
    _assert_bit_exact(dense, jaxmtp.load(tmp_path / "orbax", dtype="float32"))

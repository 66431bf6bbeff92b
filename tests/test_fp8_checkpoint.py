"""FP8 block-scaled checkpoints: dequantized exactly, or kept as 1-byte weights."""

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

import hf_reference as ref
import jaxmtp
from jaxmtp.quant import QuantizedWeight
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(directory, dequantized checkpoint tensors, HF model holding exactly those weights, token ids).
    The config has num_nextn_predict_layers = 0: no MTP layer is written or expected."""
    torch.manual_seed(0)
    config = DeepseekV3Config(**ref.FP8_CONFIG)
    config._attn_implementation = "eager"
    main = DeepseekV3ForCausalLM(config).eval()
    ref.randomize(main, 5)
    directory = str(tmp_path_factory.mktemp("fp8"))
    dequantized = ref.save_fp8(main, None, directory)
    state = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in dequantized.items()}
    reference = main  # from here on it runs with exactly the dequantized checkpoint weights
    missing, unexpected = reference.load_state_dict(_fused_experts(state, config), strict=False)
    assert not unexpected and all("rotary" in m or "inv_freq" in m for m in missing)
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    return directory, dequantized, reference, ids


def _fused_experts(state, config):
    """HF keeps experts fused in memory ([E, 2I, D] gate|up and [E, D, I]); stack the per-expert tensors."""
    out = {}
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(config.n_routed_experts)
        gate = [state.pop(f"{prefix}.{e}.gate_proj.weight") for e in experts]
        up = [state.pop(f"{prefix}.{e}.up_proj.weight") for e in experts]
        down = [state.pop(f"{prefix}.{e}.down_proj.weight") for e in experts]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[f"{prefix}.down_proj"] = torch.stack(down)
    out.update(state)
    return out


def test_dequantize_equals_numpy_dequantization_and_hf_logits(fp8):
    directory, dequantized, reference, ids = fp8
    model = jaxmtp.load(directory, dtype="float32", quantized="dequantize", quiet=True)
    kv_a = np.asarray(model.params["dense_layers"]["layers"]["self_attn"]["kv_a_proj_with_mqa"]["weight"][0])
    np.testing.assert_array_equal(kv_a, dequantized["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    expert = np.asarray(model.params["moe_layers"]["layers"]["mlp"]["experts"]["down_proj"][0, 3])
    np.testing.assert_array_equal(expert, dequantized["model.layers.1.mlp.experts.3.down_proj.weight"])
    with torch.no_grad():
        expected = reference(ids).logits.numpy()
    logits, _ = model.forward(ids.numpy())
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=1e-4)


def test_keep_holds_one_byte_weights_and_matches(fp8):
    directory, _, reference, ids = fp8
    model = jaxmtp.load(directory, dtype="float32", quantized="keep", quiet=True)
    kv_a = model.params["dense_layers"]["layers"]["self_attn"]["kv_a_proj_with_mqa"]["weight"]
    assert isinstance(kv_a, QuantizedWeight)
    assert kv_a.value.dtype == ml_dtypes.float8_e4m3fn and kv_a.value.shape == (1, 136, 160)
    assert kv_a.scale.dtype == np.float32 and kv_a.scale.shape == (1, 2, 2)  # partial tiles: ceil(136/128)
    router = model.params["moe_layers"]["layers"]["mlp"]["gate"]["weight"]
    assert router.dtype == np.float32  # the router stays in high precision
    dense = jaxmtp.load(directory, dtype="float32", quantized="dequantize", quiet=True)
    fp8_leaves = [leaf for leaf in jax.tree.leaves(model.params) if leaf.dtype == ml_dtypes.float8_e4m3fn]
    fp8_elements = sum(leaf.size for leaf in fp8_leaves)
    total_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    dense_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(dense.params))
    scale_bytes = sum(leaf.scale.nbytes for leaf in jax.tree.leaves(
        model.params, is_leaf=lambda x: isinstance(x, QuantizedWeight)) if isinstance(leaf, QuantizedWeight))
    assert total_bytes == dense_bytes - 3 * fp8_elements + scale_bytes  # 1 byte instead of 4 per FP8 weight
    with torch.no_grad():
        expected = reference(ids).logits.numpy()
    logits, _ = model.forward(ids.numpy())
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=1e-3)


def test_scale_shape_mismatch(fp8, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    d = str(tmp_path / "bad")
    shutil.copytree(fp8[0], d)
    path = f"{d}/model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] = np.ones((1, 2), np.float32)
    save_file(tensors, path)
    with pytest.raises(jaxmtp.CheckpointError,
                       match=r"kv_a_proj_with_mqa\.weight_scale_inv' has shape \[1, 2\], expected \[2, 2\]"):
        jaxmtp.load(d, quiet=True)


def test_keep_generates_the_dequantized_models_tokens(fp8):
    """Decoding gathers each token's experts; with FP8 kept, only those experts are dequantized,
    with the same formula, so greedy tokens equal the dequantized model's."""
    directory = fp8[0]
    kept = jaxmtp.load(directory, dtype="float32", quantized="keep", quiet=True)
    dense = jaxmtp.load(directory, dtype="float32", quantized="dequantize", quiet=True)
    prompts = [[1, 2, 3], [50, 60]]
    assert jaxmtp.generate(kept, prompts, max_new_tokens=8).tokens == jaxmtp.generate(dense, prompts,
                                                                                     max_new_tokens=8).tokens

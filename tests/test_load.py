"""jaxmtp.load on HF-layout directories: sharded files, and clear errors for what does not fit."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_reference as ref
import jaxmtp
from jaxmtp import CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    main, mtp = ref.build("yarn_groups", seed=11)
    directory = str(tmp_path_factory.mktemp("single"))
    return main, mtp, ref.save(main, mtp, directory)


def _copy(src, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_with_index_loads_identically(saved, tmp_path):
    main, mtp, single = saved
    sharded = str(tmp_path / "sharded")
    main.save_pretrained(sharded, max_shard_size="20KB")
    save_file(ref.mtp_state_dict(mtp, main), os.path.join(sharded, "model-mtp.safetensors"))
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 2
    for name in ref.mtp_state_dict(mtp, main):  # the index must list every file, MTP's too
        index["weight_map"][name] = "model-mtp.safetensors"
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    a, b = jaxmtp.load(single), jaxmtp.load(sharded)
    for x, y in zip(*(jax_leaves(m.params) for m in (a, b))):
        np.testing.assert_array_equal(x, y)


def jax_leaves(tree):
    import jax
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _edit(directory, fn):
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_missing_tensor(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    _edit(d, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.o_proj\.weight"):
        jaxmtp.load(d)


def test_unexpected_tensor(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    _edit(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.extra"):
        jaxmtp.load(d)


def test_wrong_shape(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    _edit(d, lambda t: t.update({"model.norm.weight": torch.zeros(7)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \[7\], expected \[32\] from config\.json"):
        jaxmtp.load(d)


def test_one_transposed_tensor_is_named_not_blamed_on_the_config(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    _edit(d, lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].T.contiguous()}))
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight' has shape \[32, \d+\], expected"):
        jaxmtp.load(d)


@pytest.mark.parametrize("field, value, found", [("n_routed_experts", 16, 8), ("hidden_size", 48, 32),
                                                  ("num_hidden_layers", 5, 4), ("first_k_dense_replace", 1, 2)])
def test_config_disagreeing_with_weights_names_the_field(saved, tmp_path, field, value, found):
    d = _copy(saved[2], tmp_path)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    assert config[field] == found
    config[field] = value
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=rf"{field} = {value} in config\.json, but the checkpoint's tensors have "
                                              rf"{found}$"):
        jaxmtp.load(d)


def test_config_dtype_that_is_no_dtype(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config | {"dtype": "float33"}, f)
    with pytest.raises(jaxmtp.ConfigError, match=r"config\.json: dtype: expected float32, bfloat16 or float16, found 'float33'"):
        jaxmtp.load(d)
    with pytest.raises(ValueError, match="dtype: expected float32, bfloat16 or float16, found 'int8'"):
        jaxmtp.load(saved[2], dtype="int8")


def test_pickle_checkpoint_is_refused(saved, tmp_path):
    d = str(tmp_path / "pickled")
    os.makedirs(d)
    shutil.copy(os.path.join(saved[2], "config.json"), d)
    with open(os.path.join(d, "pytorch_model.bin"), "wb") as f:
        f.write(b"\x80\x04not unpickled")
    with pytest.raises(CheckpointError, match="never unpickles"):
        jaxmtp.load(d)


def test_index_naming_a_missing_file(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}, f)
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors"):
        jaxmtp.load(d)


def test_mtp_copy_that_differs_warns(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    path = os.path.join(d, "model-mtp.safetensors")
    tensors = load_file(path)
    tensors["model.layers.4.embed_tokens.weight"] = tensors["model.layers.4.embed_tokens.weight"] + 1
    save_file(tensors, path)
    with pytest.warns(UserWarning, match=r"model\.layers\.4\.embed_tokens\.weight differs"):
        jaxmtp.load(d)


def test_wrong_dtype(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    _edit(d, lambda t: t.update({"model.norm.weight": torch.zeros(32, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype I32; as a dense tensor it must be"):
        jaxmtp.load(d)


def test_truncated_file(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    path = os.path.join(d, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read"):
        jaxmtp.load(d)


def test_corrupt_header(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors header"):
        jaxmtp.load(d)


def test_mtp_expected_but_absent(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    os.remove(os.path.join(d, "model-mtp.safetensors"))
    with pytest.raises(CheckpointError, match=r"num_nextn_predict_layers = 1 in config\.json promises an MTP layer, "
                                              r"but the checkpoint has none .*jaxmtp\.load\(path, mtp=False\)"):
        jaxmtp.load(d)
    main = jaxmtp.load(d, mtp=False, quiet=True)
    assert not main.config.has_mtp and "mtp" not in main.params
    # The main model's logits do not depend on the MTP layer: those of the HF reference model.
    tokens = np.random.default_rng(0).integers(0, main.config.vocab_size, (1, 9))
    with torch.no_grad():
        expected = saved[0](torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(main.forward(tokens)[0]), expected, atol=1e-4, rtol=0)
    whole = jaxmtp.load(saved[2], mtp=False, quiet=True)  # the MTP tensors present are left out
    assert "mtp" not in whole.params


def test_non_finite_weights_rejected(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    _edit(d, lambda t: t["model.layers.0.self_attn.q_a_proj.weight"].__setitem__((0, 0), float("nan")))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.q_a_proj\.weight' contains NaN or Inf"):
        jaxmtp.load(d, quiet=True)
    jaxmtp.load(d, check_finite=False, quiet=True)  # skipped only when asked


def test_non_finite_orbax_parameter_rejected(tmp_path):
    model = jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json"))
    params = dict(model.params, norm={"weight": model.params["norm"]["weight"].at[3].set(np.inf)})
    jaxmtp.save(jaxmtp.Model(model.config, params), tmp_path / "orbax", format="orbax")
    with pytest.raises(CheckpointError, match=r"parameter \['norm'\]\['weight'\] contains NaN or Inf"):
        jaxmtp.load(tmp_path / "orbax")


def test_a_model_that_cannot_fit_the_host_is_refused_before_reading(saved, monkeypatch):
    """On one CPU device the parameters are the host's: their bytes, from the abstract shapes,
    against MemAvailable, before any tensor is read; check_memory=False skips the check."""
    import jax

    from jaxmtp import memory
    from jaxmtp.checkpoint import sharded
    from jaxmtp.params import abstract_params

    config = jaxmtp.ModelConfig.from_hf_config(saved[2])
    need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_params(config)))
    monkeypatch.setattr(memory, "host_room", lambda: need - 1)
    original = sharded.TensorFiles.read
    monkeypatch.setattr(sharded.TensorFiles, "read", lambda *a, **kw: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError, match=rf"the parameters need {need:,} bytes .* of host memory \({need:,} bytes "
                                              rf".* per device \(on one device, all in host memory\)\), but "
                                              rf"MemAvailable is {need - 1:,} bytes"):
        jaxmtp.load(saved[2], quiet=True)
    monkeypatch.setattr(sharded.TensorFiles, "read", original)
    jaxmtp.load(saved[2], quiet=True, check_memory=False)
    monkeypatch.setattr(memory, "host_room", lambda: need)
    jaxmtp.load(saved[2], quiet=True)  # exactly fits

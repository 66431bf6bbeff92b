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


def test_config_disagreeing_with_weights(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    config["n_routed_experts"] = 16
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"e_score_correction_bias' has shape \[8\], expected \[16\] from config\.json"):
        jaxmtp.load(d)


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
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.4\."):
        jaxmtp.load(d)


def test_non_finite_weights_rejected_when_asked(saved, tmp_path):
    d = _copy(saved[2], tmp_path)
    _edit(d, lambda t: t["model.layers.0.self_attn.q_a_proj.weight"].__setitem__((0, 0), float("nan")))
    jaxmtp.load(d, quiet=True)  # accepted unless asked
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.q_a_proj\.weight' contains NaN or Inf"):
        jaxmtp.load(d, check_finite=True, quiet=True)

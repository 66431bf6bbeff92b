"""Checkpoint writes are all-or-nothing: a destination holds either its old content or the whole new
checkpoint, whether the save is refused, fails, is killed or replaces another format."""

import importlib
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tokenizers import Tokenizer

import jaxmtp
from jaxmtp.checkpoint import convert
from jaxmtp.params import abstract_params

# The module, which the package's save function shadows as an attribute.
save_module = importlib.import_module("jaxmtp.checkpoint.save")

# Child process for the kill test: says when it starts converting, then converts with overwrite.
CONVERT_CHILD = ("import sys; from jaxmtp.checkpoint import convert; print('converting', flush=True); "
                 "convert(sys.argv[1], sys.argv[2], sys.argv[3], overwrite=True)")


def _random_model(config, seed):
    """Random parameters of the checkpoint layout, drawn with numpy: unlike `jaxmtp.init` nothing to
    compile, and saving and loading need no more."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda t: jnp.asarray(rng.standard_normal(t.shape), t.dtype), abstract_params(config))
    return jaxmtp.Model(config, params)


@pytest.fixture(scope="module")
def models():
    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json")
    return _random_model(config, 0), _random_model(config, 1)


def _same_params(a, b):
    leaves_a, tree_a = jax.tree.flatten(a.params)
    leaves_b, tree_b = jax.tree.flatten(b.params)
    return tree_a == tree_b and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(leaves_a, leaves_b))


def _load(path):
    """Loads without the NaN/Inf scan: `_same_params` compares every bit anyway."""
    return jaxmtp.load(path, quiet=True, check_finite=False)


def _files(directory):
    """Every file under `directory` with its bytes: what "left untouched" compares."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return found


def _old_checkpoint(model, path, format):
    """A saved checkpoint with the files an HF directory usually carries beside the weights."""
    jaxmtp.save(model, path, format=format)
    for name, text in (("README.md", "# old model\n"), ("training.json", "{}\n")):
        (path / name).write_text(text)


@pytest.mark.parametrize("format", ["hf", "orbax"])
def test_non_empty_destination_is_refused_and_left_untouched(models, tmp_path, format):
    old, new = models
    _old_checkpoint(old, tmp_path / "dst", "orbax" if format == "hf" else "hf")
    before = _files(tmp_path / "dst")
    with pytest.raises(jaxmtp.CheckpointError, match=r"dst: expected a new or empty directory.*overwrite=True"):
        jaxmtp.save(new, tmp_path / "dst", format=format)
    assert _files(tmp_path / "dst") == before
    assert sorted(os.listdir(tmp_path)) == ["dst"]


def test_file_destination_is_refused(models, tmp_path):
    (tmp_path / "dst").write_text("not a checkpoint")
    with pytest.raises(jaxmtp.CheckpointError, match="dst: expected a directory .*found a file"):
        jaxmtp.save(models[0], tmp_path / "dst", overwrite=True)
    assert (tmp_path / "dst").read_text() == "not a checkpoint"


def test_extra_file_may_not_replace_a_checkpoint_file(models, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json: the checkpoint already has a config.json"):
        jaxmtp.save(models[0], tmp_path / "dst", extra_files=[tmp_path / "config.json"])
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_empty_destination_directory_takes_the_checkpoint(models, tmp_path):
    (tmp_path / "dst").mkdir()
    jaxmtp.save(models[0], tmp_path / "dst")
    assert _same_params(_load(tmp_path / "dst"), models[0])
    assert sorted(os.listdir(tmp_path)) == ["dst"]


@pytest.mark.parametrize("old_format, new_format", [("hf", "hf"), ("orbax", "hf"), ("hf", "orbax")])
def test_overwrite_replaces_the_directory_whole(models, tmp_path, old_format, new_format):
    old, new = models
    _old_checkpoint(old, tmp_path / "dst", old_format)
    jaxmtp.save(new, tmp_path / "dst", format=new_format, overwrite=True)
    left = set(os.listdir(tmp_path / "dst"))
    assert not left & {"README.md", "training.json"}
    assert (save_module.ORBAX_META in left) == (new_format == "orbax")
    assert _same_params(_load(tmp_path / "dst"), new)
    assert sorted(os.listdir(tmp_path)) == ["dst"]


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    """The overwrite tests above go through renameat2 here, not the two-rename fallback."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "was").write_text(name)
    assert save_module.exchange_directories(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [(tmp_path / name / "was").read_text() for name in ("a", "b")] == ["b", "a"]


def test_overwrite_without_an_atomic_exchange_falls_back_to_renames(models, tmp_path, monkeypatch):
    old, new = models
    _old_checkpoint(old, tmp_path / "dst", "orbax")
    monkeypatch.setattr(save_module, "exchange_directories", lambda a, b: False)
    jaxmtp.save(new, tmp_path / "dst", overwrite=True)
    assert "README.md" not in os.listdir(tmp_path / "dst")
    assert _same_params(_load(tmp_path / "dst"), new)
    assert sorted(os.listdir(tmp_path)) == ["dst"]


def _fail_hf(monkeypatch):
    """save_file writes the first shard, then fails on the second."""
    calls, original = [], save_module.save_file

    def second_fails(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        original(tensors, filename, metadata=metadata)
    monkeypatch.setattr(save_module, "save_file", second_fails)


def _fail_orbax(monkeypatch):
    def fails(self, *args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fails)


@pytest.mark.parametrize("format", ["hf", "orbax"])
def test_failed_write_leaves_the_destination_as_it_was(models, tmp_path, monkeypatch, format):
    old, new = models
    _old_checkpoint(old, tmp_path / "dst", format)
    before = _files(tmp_path / "dst")
    {"hf": _fail_hf, "orbax": _fail_orbax}[format](monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        jaxmtp.save(new, tmp_path / "dst", format=format, max_shard_bytes=64 << 10, overwrite=True)
    assert _files(tmp_path / "dst") == before
    assert sorted(os.listdir(tmp_path)) == ["dst"]


def test_convert_carries_the_tokenizer_files_and_still_takes_text(tmp_path):
    src = shutil.copytree(jaxmtp.DEMO_MODEL, tmp_path / "src")
    extra = {"tokenizer_config.json": '{"model_max_length": 512}\n', "special_tokens_map.json": "{}\n",
             "generation_config.json": '{"max_new_tokens": 8}\n'}
    for name, text in extra.items():
        (src / name).write_text(text)
    timings = convert(src, tmp_path / "dst", "orbax")
    assert set(timings) == {"load_s", "save_s", "dtype"} and timings["dtype"] == "float32"
    dst = tmp_path / "dst"
    for name in ["tokenizer.json", *extra]:
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert not {"README.md", "training.json"} & set(os.listdir(dst))
    tokenizer = Tokenizer.from_file(str(dst / "tokenizer.json"))
    text = "def add(a, b):\n    return a + b\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert _same_params(_load(dst), _load(src))


def _start_convert(src, dst, format):
    """The child converting, once it has imported jaxmtp and is about to convert."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    child = subprocess.Popen([sys.executable, "-c", CONVERT_CHILD, str(src), str(dst), format], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in child.stdout:  # warnings may come first
        if line == "converting\n":
            return child
        output.append(line)
    raise AssertionError("the child died before converting:\n" + "".join(output))


def test_kill_during_convert_leaves_the_old_or_the_new_checkpoint(tmp_path):
    """kill -9 at three moments spread over an uninterrupted convert's duration: each time the
    destination loads whole as either the old (orbax, other weights) or the new checkpoint."""
    new = _load(jaxmtp.DEMO_MODEL)
    old = _random_model(new.config, 1)
    jaxmtp.save(old, tmp_path / "pristine", format="orbax")
    dst = tmp_path / "out" / "dst"
    shutil.copytree(tmp_path / "pristine", dst)
    child = _start_convert(jaxmtp.DEMO_MODEL, dst, "hf")
    started = time.perf_counter()
    output = child.communicate(timeout=120)[0]
    assert child.returncode == 0, output
    duration = time.perf_counter() - started
    assert _same_params(_load(dst), new)
    for fraction in (0.5, 0.9):
        shutil.rmtree(tmp_path / "out")
        shutil.copytree(tmp_path / "pristine", dst)
        child = _start_convert(jaxmtp.DEMO_MODEL, dst, "hf")
        time.sleep(fraction * duration)
        child.send_signal(signal.SIGKILL)
        child.communicate()
        found = _load(dst)
        assert _same_params(found, old) or _same_params(found, new), f"killed at {fraction:.0%}: mixed checkpoint"
        assert all(name == "dst" or name.startswith(".dst.tmp-") for name in os.listdir(tmp_path / "out"))

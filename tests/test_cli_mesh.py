"""The command line on a mesh of 8 emulated CPU devices (conftest): `generate --mesh` prints the
tokens of one device, `bench` and `convert` take the flag, a mesh that does not match the devices
and a model that cannot fit are refused before any tensor is read, FP8 weights are dequantized on a
CPU by default and kept where the platform multiplies FP8, and a load onto a mesh never holds a
whole host copy of the model beside the devices' blocks (peak RSS of a real process)."""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

import generation_models as gm
import jaxmtp
from long_tests import only_long
from jaxmtp import cli, memory, quant
from jaxmtp.checkpoint import sharded
from jaxmtp.config import QuantizationConfig
from jaxmtp.params import abstract_params, param_shardings
from jaxmtp.quant import QuantizedWeight, quantize_params

BLOCK = (16, 16)  # FP8 scale blocks that the tensor axis cuts through (dims of 32..128)
PROMPT = "3,4,5"
GENERATE = ["--tokens", PROMPT, "--k", "2", "--max-new-tokens", "6", "--quiet"]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A tiny FP8 V3 checkpoint (MTP layer included) whose dims divide a mesh of 8."""
    config = gm.MESH_CONFIG.replace(quantization=QuantizationConfig(weight_block_size=BLOCK))
    model = gm.model("partial", gm.MESH_CONFIG)
    path = tmp_path_factory.mktemp("fp8_v3")
    jaxmtp.save(jaxmtp.Model(config, quantize_params(model.params, BLOCK)), path)
    return str(path)


@pytest.fixture
def loaded(monkeypatch):
    """The models the command line loads, as it loads them."""
    models = []
    original = jaxmtp.load

    def spy(*args, **kwargs):
        models.append(original(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(jaxmtp, "load", spy)
    return models


def _generated(text: str) -> list[str]:
    """The prompt -> tokens lines of `jaxmtp generate`'s output."""
    return [line for line in text.splitlines() if " -> " in line]


@pytest.fixture(scope="module")
def single_device_tokens(fp8_dir):
    return _run_generate(fp8_dir, [])


def _run_generate(fp8_dir, extra):
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        cli.main(["generate", "--model", fp8_dir, *GENERATE, *extra])
    lines = _generated(out.getvalue())
    assert len(lines) == 1 and lines[0].startswith("[3, 4, 5] -> "), out.getvalue()
    return lines


@pytest.mark.parametrize("mesh, sizes", [("data=2,expert=2,tensor=2", (2, 2, 2)), pytest.param(
    "expert=4,tensor=2", (1, 4, 2), marks=only_long("data=2,expert=2,tensor=2 splits the experts and heads too"))])
def test_generate_on_a_mesh_prints_the_single_device_tokens(fp8_dir, single_device_tokens, loaded, mesh, sizes):
    assert _run_generate(fp8_dir, ["--mesh", mesh]) == single_device_tokens
    (model,) = loaded
    assert tuple(model.mesh.shape.values()) == sizes
    experts = model.params["moe_layers"]["layers"]["mlp"]["experts"]["gate_proj"]
    split = sizes[0] * sizes[1]  # experts over data x expert
    assert {shard.data.shape[1] for shard in experts.addressable_shards} == {gm.MESH_CONFIG.n_routed_experts // split}


def test_bench_runs_on_a_mesh(capsys, fp8_dir, loaded):
    cli.main(["bench", "--model", fp8_dir, "--tokens", PROMPT, "--ks", "1", "--no-auto", "--repeats", "1",
              "--max-new-tokens", "4", "--json", "--mesh", "expert=8"])
    captured = capsys.readouterr()
    figures = json.loads(captured.out)
    assert [row["k"] for row in figures["rows"]] == [0, 1]
    assert loaded[0].mesh.shape["expert"] == 8
    line = "FP8 weights: dequantized at load (cpu has no FP8 matmul; --matmul fp8|dequant keeps them FP8)"
    assert line in captured.err


def test_convert_on_a_mesh_writes_the_sources_parameters(capsys, fp8_dir, tmp_path):
    dst = tmp_path / "hf"
    cli.main(["convert", fp8_dir, str(dst), "--format", "hf", "--mesh", "data=2,expert=2,tensor=2"])
    assert "load" in capsys.readouterr().out
    source = jaxmtp.load(fp8_dir, quantized="keep", quiet=True)
    written = jaxmtp.load(dst, quantized="keep", quiet=True)
    assert jax.tree.structure(written.params) == jax.tree.structure(source.params)
    for a, b in zip(jax.tree.leaves(source.params), jax.tree.leaves(written.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(leaf.dtype == ml_dtypes.float8_e4m3fn for leaf in jax.tree.leaves(written.params))


@pytest.mark.parametrize("quantized, sizes", [("keep", (2, 2, 2)), ("dequantize", (1, 8, 1))])
def test_deepseek_rank_files_load_onto_a_mesh_block_by_block(fp8_dir, tmp_path, monkeypatch, quantized, sizes):
    """DeepSeek's model{rank}-mp{n} files onto a mesh: each device's block is read from the ranks
    that hold it (with tensor=2 a rank's half is a device's block; with no tensor axis the halves
    are joined), equal to the HF layout's load."""
    import official_format

    ranks = official_format.convert(fp8_dir, str(tmp_path / "mp2"), n_experts=8, mp=2,
                                    mtp_layer=gm.MESH_CONFIG.num_hidden_layers)
    expected = jaxmtp.load(fp8_dir, quantized=quantized, mtp=False, quiet=True)
    shapes = {}
    original = sharded.TensorFiles.read

    def spy(self, name, region=(), bar=None):
        value = original(self, name, region, bar)
        shapes.setdefault(name, set()).add(value.shape)
        return value

    monkeypatch.setattr(sharded.TensorFiles, "read", spy)
    with pytest.warns(UserWarning, match="carries no MTP layer"):
        got = jaxmtp.load(ranks, quantized=quantized, quiet=True, mesh=jaxmtp.make_mesh(*sizes))
    config = gm.MESH_CONFIG
    q_b = config.num_attention_heads * config.qk_head_dim
    assert shapes["layers.0.attn.wq_b.weight"] == {(q_b // 2, config.q_lora_rank)}  # each read: one rank's half
    assert jax.tree.structure(got.params) == jax.tree.structure(expected.params)
    for a, b in zip(jax.tree.leaves(expected.params), jax.tree.leaves(got.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _one_error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _no_read(*args, **kwargs):
    raise AssertionError("a tensor was read before the refusal")


@pytest.mark.parametrize("mesh, count", [("data=2,expert=8", 16), ("data=3", 3), ("tensor=2", 2)])
@pytest.mark.parametrize("command", ["generate", "bench", "forward"])
def test_a_mesh_that_is_not_the_device_count_is_refused(capsys, monkeypatch, fp8_dir, mesh, count, command):
    monkeypatch.setattr(sharded.TensorFiles, "read", _no_read)
    line = _one_error_line(capsys, [command, "--model", fp8_dir, "--tokens", PROMPT, "--mesh", mesh])
    assert line.startswith(f"jaxmtp {command}: error: --mesh ") and f"= {count} devices" in line
    assert "jax.device_count() is 8" in line and "--xla_force_host_platform_device_count" in line


def test_convert_refuses_a_mesh_that_is_not_the_device_count(capsys, fp8_dir, tmp_path):
    line = _one_error_line(capsys, ["convert", fp8_dir, str(tmp_path / "out"), "--format", "hf", "--mesh", "expert=4"])
    assert "= 4 devices" in line and "jax.device_count() is 8" in line
    assert not (tmp_path / "out").exists()


def test_a_model_that_cannot_fit_is_refused_before_any_tensor_is_read(capsys, monkeypatch, fp8_dir):
    """On a CPU the devices share host memory: the bytes every device holds against MemAvailable."""
    monkeypatch.setattr(memory, "host_room", lambda: 4096)
    monkeypatch.setattr(sharded.TensorFiles, "read", _no_read)
    line = _one_error_line(capsys, ["generate", "--model", fp8_dir, *GENERATE, "--mesh", "expert=8"])
    config = jaxmtp.ModelConfig.from_hf_config(fp8_dir)
    target = abstract_params(config, np.float32)  # dequantized at load on a CPU
    mesh = jaxmtp.make_mesh(expert=8)
    per_device = max(memory.bytes_per_device(target, param_shardings(config, target, mesh)).values())
    assert line.startswith(f"jaxmtp generate: error: --model {fp8_dir}: the parameters need ")
    assert f"{per_device:,} bytes" in line and "per device (on a mesh of 8 devices" in line
    assert "MemAvailable is 4,096 bytes" in line and "--mesh" in line and "XLA_CLIENT_MEM_FRACTION" in line


def test_bytes_per_device_are_what_the_loaded_devices_hold(fp8_dir):
    """The fit check's figures, from abstract shapes and shardings, against the shards a load
    onto the mesh really places, FP8 values and scales kept."""
    mesh = jaxmtp.make_mesh(data=2, expert=2, tensor=2)
    model = jaxmtp.load(fp8_dir, quantized="keep", mesh=mesh, quiet=True)
    target = abstract_params(model.config, np.float32, keep_fp8=True)
    predicted = memory.bytes_per_device(target, param_shardings(model.config, target, mesh))
    held = dict.fromkeys(jax.devices(), 0)
    for leaf in jax.tree.leaves(model.params):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    assert predicted == held


class _FakeGpu:
    platform = "gpu"

    def __init__(self, limit, used):
        self.stats = {"bytes_limit": limit, "bytes_in_use": used}

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return "cuda:0"


def test_on_a_gpu_the_allocators_limit_is_the_room(monkeypatch):
    """Per device against the allocator's limit less what is in use (XLA_CLIENT_MEM_FRACTION
    already shapes the limit); the host is not asked when the loader stages nothing there."""
    target = {"w": jax.ShapeDtypeStruct((1000,), np.float32)}
    monkeypatch.setattr(memory, "host_room", _no_read)
    monkeypatch.setattr(memory, "bytes_per_device", lambda *args: {_FakeGpu(5000, 1500): 4000})
    with pytest.raises(jaxmtp.CheckpointError, match=r"x: the parameters need 4,000 bytes \(0\.00 GB\) per device "
                                                     r"\(on one device\), but cuda:0 has 3,500 bytes .*allocator's "
                                                     r"limit 5,000 bytes.*XLA_CLIENT_MEM_FRACTION"):
        memory.check_fits(target, source="x")
    monkeypatch.setattr(memory, "bytes_per_device", lambda *args: {_FakeGpu(5000, 1000): 4000})
    memory.check_fits(target, source="x")  # exactly fits


def test_fp8_weights_are_dequantized_on_a_cpu_and_kept_where_the_platform_multiplies_fp8(fp8_dir, monkeypatch,
                                                                                         tmp_path):
    choice, reason = quant.fp8_choice()
    assert choice == "dequantize" and reason.startswith("dequantized at load (cpu has no FP8 matmul")
    assert not quant.is_quantized(jaxmtp.load(fp8_dir, quiet=True).params)
    kept = jaxmtp.load(fp8_dir, matmul="dequant", quiet=True)  # a matmul keeps them FP8
    assert kept.params["moe_layers"]["layers"]["mlp"]["experts"]["up_proj"].matmul == "dequant"
    with pytest.raises(jaxmtp.InputError, match="matmul='fp8' applies to FP8 weights kept"):
        jaxmtp.load(fp8_dir, quantized="dequantize", matmul="fp8")

    monkeypatch.setattr(quant, "default_matmul", lambda: "fp8")  # a platform with FP8 matmul
    assert quant.fp8_choice() == ("keep", "kept FP8, multiplied by the W8A8 kernels (cpu multiplies FP8)")
    weight = jaxmtp.load(fp8_dir, quiet=True).params["moe_layers"]["layers"]["mlp"]["experts"]["up_proj"]
    assert isinstance(weight, QuantizedWeight) and weight.matmul == "dequant"  # 16x16 blocks: no kernel for them
    assert "the W8A8 kernels take 128x128 blocks, this checkpoint has 16x16" in quant.fp8_choice(block=BLOCK)[1]
    config = gm.MESH_CONFIG.replace(quantization=QuantizationConfig())
    jaxmtp.save(jaxmtp.Model(config, quantize_params(gm.model("partial", gm.MESH_CONFIG).params)), tmp_path)
    weight = jaxmtp.load(tmp_path, quiet=True).params["moe_layers"]["layers"]["mlp"]["experts"]["up_proj"]
    assert isinstance(weight, QuantizedWeight) and weight.matmul == "fp8"


def test_distributed_initializes_first_and_only_process_0_prints(capsys, monkeypatch):
    """--distributed: jax.distributed.initialize() with no arguments before the command runs; the
    command's output shows on process 0 only, and its progress lines are off elsewhere."""
    events = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: events.append(("initialize", a, kw)))

    def command(args):
        events.append(("run", args.quiet))
        print("tokens")

    monkeypatch.setattr(cli, "_generate", command)
    for process, shown in ((1, ""), (0, "tokens\n")):
        events.clear()
        monkeypatch.setattr(jax, "process_index", lambda: process)
        cli.main(["generate", "--distributed", "--tokens", "1,2"])
        assert events == [("initialize", (), {}), ("run", process != 0)]
        assert capsys.readouterr().out == shown


# Loads the checkpoint argv[1] onto an expert=8 mesh (argv[2] "mesh") or onto one device and then
# places it there (argv[2] "staged": a whole host copy beside the devices' blocks), and prints the
# peak RSS growth over the load with the bytes the devices hold. The abstract parameters and
# shardings, which the loader computes first, are computed before the baseline, so that what is
# measured is the data (and not the code pages and caches of a first trace). The peak is the
# kernel's VmHWM, reset to the current RSS just before the load (/proc/self/clear_refs): the
# getrusage figure of a child process starts at its parent's RSS (Linux carries it across exec).
RSS_CHILD = r"""
import json, sys
import jax, numpy as np, jaxmtp
from jaxmtp.memory import check_fits
from jaxmtp.params import abstract_params, param_shardings
from jaxmtp.sharding import place

path, mode = sys.argv[1:]
mesh = jaxmtp.make_mesh(expert=8)
config = jaxmtp.ModelConfig.from_hf_config(path)
target = abstract_params(config)
check_fits(target, param_shardings(config, target, mesh))
jax.device_put(np.zeros(4), jax.devices()[1]).block_until_ready()

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = kib("VmRSS")
if mode == "mesh":
    model = jaxmtp.load(path, mesh=mesh, quiet=True)
else:
    single = jaxmtp.load(path, quiet=True)
    model = jaxmtp.Model(config, place(single.params, param_shardings(config, single.params, mesh)), mesh)
jax.block_until_ready(model.params)
growth = (kib("VmHWM") - before) * 1024
held = sum(shard.data.nbytes for leaf in jax.tree.leaves(model.params) for shard in leaf.addressable_shards)
print(json.dumps({"growth": growth, "held": held}))
"""


def _peak_growth(path, mode):
    run = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path), mode], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures the peak RSS with Linux's /proc")
def test_a_load_onto_a_mesh_never_holds_a_host_copy_of_the_model(tmp_path):
    """Peak RSS of a process loading 162 MB of float32 weights (routed experts 93% of them) onto
    8 emulated devices with the experts split 8 ways. The devices live in the process, so it must
    hold their blocks (the experts once, the rest 8 times); beyond that it may hold one
    checkpoint file and a margin (32 MB), which a whole host copy of the model (loaded, then placed)
    exceeds."""
    config = jaxmtp.ModelConfig.from_hf_config(f"{jaxmtp.CONFIGS}/tiny.json").replace(
        hidden_size=128, num_attention_heads=8, q_lora_rank=32, moe_intermediate_size=2048, n_routed_experts=16,
        num_hidden_layers=4, num_nextn_predict_layers=0)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda leaf: rng.standard_normal(leaf.shape, np.float32) * 0.02, abstract_params(config))
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    jaxmtp.save(jaxmtp.Model(config, params), tmp_path, max_shard_bytes=8 << 20)
    del params
    largest_file = max(os.path.getsize(tmp_path / name) for name in os.listdir(tmp_path))
    mesh, staged = _peak_growth(tmp_path, "mesh"), _peak_growth(tmp_path, "staged")
    bound = mesh["held"] + largest_file + (32 << 20)  # allocator and runtime noise: a few MB from run to run
    assert mesh["growth"] <= bound < mesh["held"] + whole, (mesh, whole, largest_file)
    assert staged["growth"] > bound, (staged, bound)  # the measurement sees a host copy

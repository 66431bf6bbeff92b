"""The command line's reports: a bad argument or input file fails with one line and exit status 2
before any long work, a bug keeps its traceback, --help shows the defaults, and the default configs
are found from any working directory. Everything runs in-process."""

import json
import os

import pytest

import jaxmtp
from jaxmtp import cli
from jaxmtp.cli import main
from jaxmtp.config import config_file


def _fails(capsys, argv) -> str:
    """Runs `jaxmtp argv`, expecting exit status 2 without a traceback; returns stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _one_line(capsys, argv) -> str:
    """Like `_fails`, and stderr is exactly one line; returns it."""
    err = _fails(capsys, argv)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0], err
    return lines[0]


@pytest.mark.parametrize("argv, flag, value", [
    (["generate", "--tokens", "1,a"], "--tokens", "1,a"),
    (["generate", "--tokens", "1,2;"], "--tokens", "1,2;"),
    (["forward", "--tokens", "1,-2"], "--tokens", "1,-2"),
    (["plan", "--config", "c.json", "--mesh", "expert=x"], "--mesh", "expert=x"),
    (["plan", "--config", "c.json", "--mesh", "pipeline=2"], "--mesh", "pipeline"),
    (["plan", "--config", "c.json", "--mesh", "tensor=0"], "--mesh", "tensor=0"),
    (["bench", "--ks", "a"], "--ks", "a"),
    (["bench", "--ks", "1,9"], "--ks", "1,9"),
    (["bench", "--ks", "0,1"], "--ks", "0,1"),
    (["generate", "--k", "-1"], "--k", "-1"),
    (["generate", "--k", "two"], "--k", "two"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens", "0"),
    (["train", "--out", "o", "--steps", "-3"], "--steps", "-3"),
    (["train", "--out", "o", "--batch", "0"], "--batch", "0"),
    (["train", "--out", "o", "--seq-len", "1.5"], "--seq-len", "1.5"),
    (["bench", "--repeats", "0"], "--repeats", "0"),
    (["bench", "--prompts", "0"], "--prompts", "0"),
    (["bench", "--prompt-len", "-1"], "--prompt-len", "-1"),
    (["info", "--config", "c.json", "--length", "0"], "--length", "0"),
    (["generate", "--temperature", "-0.5"], "--temperature", "-0.5"),
    (["generate", "--temperature", "nan"], "--temperature", "nan"),
    (["generate", "--temperature", "inf"], "--temperature", "inf"),
    (["generate", "--top-p", "0"], "--top-p", "0"),
    (["generate", "--top-p", "1.5"], "--top-p", "1.5"),
    (["generate", "--top-k", "-1"], "--top-k", "-1"),
    (["train", "--out", "o", "--lr", "0"], "--lr", "0"),
    (["train", "--out", "o", "--lr", "inf"], "--lr", "inf"),
    (["convert", "a", "b", "--format", "hf", "--dtype", "int8"], "--dtype", "int8"),
    (["generate", "--mesh", "expert=x"], "--mesh", "expert=x"),
    (["bench", "--mesh", "tensor=0"], "--mesh", "tensor=0"),
    (["forward", "--mesh", "pipeline=2"], "--mesh", "pipeline"),
    (["convert", "a", "b", "--format", "hf", "--mesh", "data=2,"], "--mesh", "data=2,"),
    (["generate", "--matmul", "int8"], "--matmul", "int8"),
])
def test_a_bad_flag_value_is_refused_by_argparse(capsys, argv, flag, value):
    err = _fails(capsys, argv)
    last = err.splitlines()[-1]
    assert last.startswith(f"jaxmtp {argv[0]}: error: argument {flag}: "), err
    assert value in last


def test_flag_values_are_parsed():
    args = cli.build_parser().parse_args(["bench", "--tokens", "1,2;3", "--ks", "1,8"])
    assert args.tokens == [[1, 2], [3]] and args.ks == [1, 8]
    args = cli.build_parser().parse_args(["plan", "--config", "c.json", "--mesh", "expert=4,tensor=2", "--k", "0"])
    assert args.mesh == {"data": 1, "expert": 4, "tensor": 2} and args.k == 0
    assert args.loop == "both" and not args.greedy  # the auto loop with sampling, beside --k
    assert cli.build_parser().parse_args(["generate"]).k == "auto"
    for command in (["generate"], ["bench"], ["forward"], ["convert", "a", "b", "--format", "hf"]):
        args = cli.build_parser().parse_args([*command, "--mesh", "data=2,expert=2", "--distributed"])
        assert args.mesh == {"data": 2, "expert": 2, "tensor": 1} and args.distributed
        assert cli.build_parser().parse_args(command).mesh is None
    assert cli.build_parser().parse_args(["convert", "a", "b", "--format", "hf", "--overwrite"]).overwrite


def test_a_missing_model_directory_is_one_line(capsys, tmp_path):
    line = _one_line(capsys, ["generate", "--model", str(tmp_path / "none"), "--tokens", "1,2"])
    assert line == f"jaxmtp generate: error: --model {tmp_path / 'none'}: not a checkpoint directory"


def test_a_missing_config_file_is_one_line(capsys, tmp_path):
    line = _one_line(capsys, ["info", "--config", str(tmp_path / "none.json")])
    assert line.startswith(f"jaxmtp info: error: --config {tmp_path / 'none.json'}")


def test_a_bad_config_field_is_one_line_naming_it(capsys, tmp_path):
    with open(os.path.join(jaxmtp.CONFIGS, "tiny.json")) as f:
        raw = json.load(f)
    raw["rms_norm_eps"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    line = _one_line(capsys, ["info", "--config", str(tmp_path / "bad.json")])
    assert line.startswith(f"jaxmtp info: error: --config {tmp_path / 'bad.json'}: rms_norm_eps")


def test_a_token_id_outside_the_vocabulary_is_one_line(capsys):
    line = _one_line(capsys, ["generate", "--tokens", "1,99999", "--k", "0", "--max-new-tokens", "2", "--quiet"])
    assert line.startswith("jaxmtp generate: error: ") and "99999" in line


@pytest.mark.parametrize("extra", [["--steps", "0"], ["--mtp-only"], ["--mtp-depth", "2"], ["--init", "x"],
                                   ["--config", "missing.json"]])
def test_a_bad_train_argument_fails_at_once_and_creates_nothing(capsys, monkeypatch, tmp_path, extra):
    def no_data():
        raise AssertionError("the corpus was read before the arguments were checked")

    from jaxmtp import data

    monkeypatch.setattr(data, "source_files", no_data)
    out = tmp_path / "x"
    _fails(capsys, ["train", "--out", str(out), *extra])
    assert not out.exists()


def test_train_refuses_a_non_empty_out_before_training(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("kept")
    line = _one_line(capsys, ["train", "--out", str(tmp_path), "--steps", "1"])
    assert str(tmp_path) in line and "--overwrite" in line
    assert os.listdir(tmp_path) == ["notes.txt"]


def _no_load(*args, **kwargs):
    raise AssertionError("the checkpoint was loaded before the arguments were checked")


@pytest.mark.parametrize("name, message", [(os.path.join("nonexistent_dir", "x.png"), "does not exist"),
                                           ("x.notanimage", "file type")])
def test_bench_checks_the_plot_path_before_loading(capsys, monkeypatch, tmp_path, name, message):
    monkeypatch.setattr(jaxmtp, "load", _no_load)
    line = _one_line(capsys, ["bench", "--plot", str(tmp_path / name)])
    assert line.startswith(f"jaxmtp bench: error: --plot {tmp_path / name}: ") and message in line


def test_convert_refuses_a_non_empty_destination_without_overwrite(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(jaxmtp.checkpoint, "load", _no_load)
    (tmp_path / "old.txt").write_text("kept")
    line = _one_line(capsys, ["convert", jaxmtp.DEMO_MODEL, str(tmp_path), "--format", "orbax"])
    assert line.startswith("jaxmtp convert: error: ") and str(tmp_path) in line and "--overwrite" in line


def test_convert_writes_the_demo_model_and_replaces_with_overwrite(capsys, tmp_path):
    dst = tmp_path / "demo"
    main(["convert", jaxmtp.DEMO_MODEL, str(dst), "--format", "orbax"])
    assert "load" in capsys.readouterr().out
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(dst))
    (dst / "stale.txt").write_text("old")
    main(["convert", jaxmtp.DEMO_MODEL, str(dst), "--format", "hf", "--overwrite"])
    assert "stale.txt" not in os.listdir(dst) and "model.safetensors.index.json" in os.listdir(dst)


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(args):
        return 1 / 0

    monkeypatch.setattr(cli, "_info", broken)
    with pytest.raises(ZeroDivisionError):
        main(["info", "--config", "c.json"])


def test_a_type_error_inside_jaxmtp_but_not_from_a_check_is_a_bug(monkeypatch):
    from jaxmtp.generation import bucket

    def broken(args):
        return bucket("7", 16)  # fails at a comparison in jaxmtp's code, not at a raise

    monkeypatch.setattr(cli, "_info", broken)
    with pytest.raises(TypeError, match="not supported"):
        main(["info", "--config", "c.json"])


def test_debug_shows_the_traceback_of_a_user_error(tmp_path):
    with pytest.raises(cli.UsageError, match="not a checkpoint directory") as raised:
        main(["--debug", "generate", "--model", str(tmp_path / "none"), "--tokens", "1"])
    assert isinstance(raised.value.__cause__, jaxmtp.CheckpointError)


@pytest.mark.parametrize("command", ["info", "forward", "generate", "bench", "plan", "train", "convert"])
def test_help_shows_the_defaults(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "(default: " in capsys.readouterr().out


def test_help_shows_the_values_used(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: auto)" in text and "generation_config.json, else 64" in text
    assert "(default: None)" not in text and "(default: [])" not in text


def test_configs_are_found_by_name_from_another_directory(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    main(["info", "--config", "deepseek_v3_671b"])
    assert "671.03 B" in capsys.readouterr().out  # the published 671B config's main-model parameters
    # forward's and train's defaults are such names (running forward would compile a model here).
    for command in (["forward"], ["train", "--out", "x"]):
        default = cli.build_parser().parse_args(command).config
        assert os.path.isfile(config_file(default)), (command, default)


def test_the_bench_plot_shows_every_k_on_integer_positions(tmp_path):
    from jaxmtp import bench

    rows = [{"k": 0, "per_position_acceptance": [], "decode_speedup": 1.0}]
    rows += [{"k": k, "per_position_acceptance": [0.9 - 0.1 * i for i in range(k)], "decode_speedup": s}
             for k, s in ((1, 0.02), (2, 1.3), (3, 1.1))]
    rows.append({"k": "auto", "per_position_acceptance": [0.9, 0.8], "decode_speedup": 1.4})
    fig = bench.plot(rows, str(tmp_path / "bench.png"))
    acceptance, speedup = fig.axes
    assert list(acceptance.get_xticks()) == [1, 2, 3]
    assert [t.get_text() for t in speedup.get_xticklabels()] == ["0", "1", "2", "3", "auto"]
    assert len(speedup.patches) == len(rows) and speedup.get_ylim()[0] == 0
    fig.canvas.draw()
    legend = acceptance.get_legend().get_window_extent()
    assert legend.y1 < acceptance.get_window_extent().y0  # below the axes, covering no line
    assert (tmp_path / "bench.png").stat().st_size > 0

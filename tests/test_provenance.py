"""Results imported from a device run say what the device recorded: each results JSON that names
its raw folder (benchmarks/results/<run>/) has the commit, uncommitted flag, versions and device
that folder's files record, read here on their own; another commit only as tree_commit, with its
reason. tools/import_device_run.py makes exactly the committed results from the kept folders, and
keeps the recorded commit and flag in place of any it is told."""

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _tool():
    spec = importlib.util.spec_from_file_location("import_device_run", ROOT / "tools" / "import_device_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results() -> list[tuple[str, dict]]:
    return [(path.name, json.loads(path.read_text())) for path in sorted(RESULTS.glob("*.json"))]


def _device_results() -> list[tuple[str, dict]]:
    return [(name, r) for name, r in _results() if "imported_from" in r["provenance"]]


def _raw(folder: pathlib.Path) -> dict:
    """What the run's own files record: device.txt's nvidia-smi row and `git rev-parse HEAD`,
    console.log's versions, and the uncommitted flag of a provenance written in the run at that
    commit (the run's provenance.json first), else None."""
    lines = [line.strip() for line in (folder / "device.txt").read_text().splitlines() if line.strip()]
    kind, driver, memory = (part.strip() for part in lines[1].split(","))
    jax_version, flax_version = re.search(r"^jax (\S+) flax (\S+)", (folder / "console.log").read_text(), re.M).groups()
    dirty = None
    for path in sorted(folder.glob("*.json"), key=lambda p: p.name != "provenance.json"):
        recorded = json.loads(path.read_text())
        recorded = recorded.get("provenance", recorded) if path.name != "provenance.json" else recorded
        if isinstance(recorded, dict) and recorded.get("commit") == lines[2]:
            dirty = recorded["uncommitted_changes"]
            break
    return {"commit": lines[2], "uncommitted_changes": dirty, "jax": jax_version, "flax": flax_version,
            "kind": kind, "driver": driver, "memory": memory}


def test_results_from_a_device_name_a_kept_raw_folder():
    for name, result in _results():
        p = result["provenance"]
        if p["device"]["platform"] == "cpu":
            continue
        assert "imported_from" in p, f"{name}: a device's result names the raw folder it was imported from"
        folder = ROOT / p["imported_from"]
        assert folder.is_dir() and (folder / "device.txt").exists(), f"{name}: {p['imported_from']} is not kept"


@pytest.mark.parametrize("name", [name for name, _ in _device_results()])
def test_device_results_keep_what_the_device_recorded(name):
    result = json.loads((RESULTS / name).read_text())
    p = result["provenance"]
    raw = _raw(ROOT / p["imported_from"])
    assert p["commit"] == raw["commit"], f"{name}: commit {p['commit']}, the device recorded {raw['commit']}"
    assert p["uncommitted_changes"] is raw["uncommitted_changes"], (
        f"{name}: uncommitted_changes {p['uncommitted_changes']}, the run recorded {raw['uncommitted_changes']}")
    assert (p["versions"]["jax"], p["versions"]["flax"]) == (raw["jax"], raw["flax"]), name
    assert p["device"]["kind"] == raw["kind"], name
    if "driver" in p["device"]:
        assert (p["device"]["driver"], p["device"]["memory"]) == (raw["driver"], raw["memory"]), name
    if "tree_commit" in p:
        assert re.fullmatch(r"[0-9a-f]{40}", p["tree_commit"]) and p["tree_commit"] != p["commit"], name
        assert len(p.get("tree_reason", "")) > 20, f"{name}: tree_commit {p['tree_commit']} without a reason"
    copied = ROOT / p["imported_from"] / f"{result['benchmark']}.json"
    written = json.loads(copied.read_text()) if copied.exists() else {}
    if "provenance" in written:  # a step's own result: its provenance as written, plus where it came from
        kept = {k: v for k, v in p.items() if k not in ("imported_from", "tree_commit", "tree_reason")}
        assert kept == written["provenance"] and result["figures"] == written["figures"], name


@pytest.mark.parametrize("name", [name for name, _ in _device_results()])
def test_the_importer_makes_the_committed_result_from_its_raw_folder(name):
    result = json.loads((RESULTS / name).read_text())
    p = result["provenance"]
    made = _tool().results(str(ROOT / p["imported_from"]), date=p["date"][:10], commit=p.get("tree_commit"),
                           reason=p.get("tree_reason"), only=(result["benchmark"],))
    written = json.loads(json.dumps(made[result["benchmark"]]))  # as written: JSON's keys are strings
    assert written == result, f"{name} differs from what its raw folder gives"


def _commit(repo: pathlib.Path) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin:/usr/local/bin"}
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "tree"], cwd=repo, env=env, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run folder inside a scratch repository: device.txt naming an older commit, console.log, a
    decode_step.log copied from a kept run."""
    tool = _tool()
    monkeypatch.setattr(tool, "ROOT", str(tmp_path))
    folder = tmp_path / "benchmarks" / "results" / "run"
    folder.mkdir(parents=True)
    recorded = "ab" * 20
    smi = "name, driver_version, memory.total [MiB]\nNVIDIA H200, 1.2, 1 MiB"
    (folder / "device.txt").write_text(f"{smi}\n{recorded}\n")
    (folder / "console.log").write_text("jax 0.1 flax 0.2 [CudaDevice(id=0)]\n== decode_step (10:00:00)\n")
    shutil.copy(RESULTS / "h200" / "decode_step.log", folder / "decode_step.log")
    return tool, folder, recorded, _commit(tmp_path)


def test_the_importer_keeps_the_recorded_commit_and_an_unrecorded_flag_as_unknown(run):
    tool, folder, recorded, _ = run
    p = tool.results(str(folder), date="2020-01-02")["decode_step"]["provenance"]
    assert (p["commit"], p["uncommitted_changes"], p["date"]) == (recorded, None, "2020-01-02T10:00:00+00:00")
    assert "tree_commit" not in p and p["imported_from"] == "benchmarks/results/run"


def test_the_importer_takes_the_flag_from_the_runs_own_provenance(run):
    tool, folder, recorded, _ = run
    own = {"commit": recorded, "uncommitted_changes": True, "engine_sha256": "e" * 64,
           "versions": {"python": "3.12.3", "jax": "0.1", "jaxlib": "0.1", "flax": "0.2"}}
    (folder / "provenance.json").write_text(json.dumps(own))
    made = tool.results(str(folder), date="2020-01-02")
    assert set(made) == {"decode_step"}, "the run's provenance.json is not a step's result"
    p = made["decode_step"]["provenance"]
    assert (p["uncommitted_changes"], p["engine_sha256"], p["versions"]["python"]) == (True, "e" * 64, "3.12.3")
    own["versions"]["jax"] = "0.9"
    (folder / "provenance.json").write_text(json.dumps(own))
    with pytest.raises(ValueError, match="jax 0.9"):
        tool.results(str(folder), date="2020-01-02")


def test_the_importer_keeps_another_tree_commit_beside_the_recorded_one(run):
    tool, folder, recorded, tree = run
    step = {"benchmark": "sparse_attention", "figures": [1], "raw": {},
            "provenance": {"commit": recorded, "uncommitted_changes": True, "versions": {"jax": "0.1"}}}
    (folder / "sparse_attention.json").write_text(json.dumps(step))
    with pytest.raises(ValueError, match="--commit and --reason"):
        tool.results(str(folder), date="2020-01-02", commit=tree[:7])
    with pytest.raises(ValueError, match="not a commit"):
        tool.results(str(folder), date="2020-01-02", commit="0" * 40, reason="the tree sent")
    made = tool.results(str(folder), date="2020-01-02", commit=tree[:7], reason="the tree sent")
    for result in made.values():
        p = result["provenance"]
        assert (p["commit"], p["uncommitted_changes"], p["tree_commit"], p["tree_reason"]) == (
            recorded, True, tree, "the tree sent")  # the flag from the step's own provenance, for the whole run


def test_the_importer_refuses_a_folder_outside_the_repository(run, tmp_path_factory):
    tool, folder, _, _ = run
    outside = tmp_path_factory.mktemp("outside") / "run"
    shutil.copytree(folder, outside)
    with pytest.raises(ValueError, match="keep the run's folder in benchmarks/results/"):
        tool.results(str(outside), date="2020-01-02")


def test_provenance_records_the_engine_the_flag_and_the_prompts(monkeypatch):
    from jaxmtp import data, provenance

    p = provenance.provenance(3, prompts_sha256=data.prompts_sha256())
    assert p["engine_sha256"] == provenance.engine_sha256(str(ROOT)) and p["repeats"] == 3
    assert p["prompts_sha256"] == data.prompts_sha256()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                            text=True)
    if status.returncode == 0:
        assert p["uncommitted_changes"] is bool(status.stdout.strip())
    monkeypatch.setattr(provenance, "_git", lambda *args: "")  # no git: neither the commit nor the flag is known
    p = provenance.provenance(1)
    assert (p["commit"], p["uncommitted_changes"]) == (None, None) and "prompts_sha256" not in p

"""docs/performance.md and the README's results table are what benchmarks/render.py renders from
the results JSON now, every results file carries its provenance, and every footnote names the
commit its figures were measured at, the uncommitted flag, and whether the engine changed since."""

import hashlib
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess

import pytest

from jaxmtp import data
from jaxmtp.provenance import engine_sha256

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _render():
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_page_and_readme_table_are_rendered_from_the_results():
    render = _render()
    try:
        page = render.page()
    except LookupError as e:  # a shallow clone: the results' commits are not there to compare the engine with
        pytest.skip(str(e))
    assert (ROOT / "docs" / "performance.md").read_text() == page, "run python benchmarks/render.py"
    readme = (ROOT / "README.md").read_text()
    assert render.START in readme and readme == render.readme(readme), "run python benchmarks/render.py"


def test_every_result_has_its_provenance():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files
    for path in files:
        result = json.loads(path.read_text())
        provenance = result["provenance"]
        for field in ("date", "commit", "versions", "device", "flags", "command", "repeats"):
            assert field in provenance, f"{path.name}: provenance lacks {field}"
        assert len(provenance["commit"]) == 40 and "raw" in result, path.name


def test_every_footnote_names_its_commit_and_flag():
    page = (ROOT / "docs" / "performance.md").read_text()
    sources = re.findall(r"^\*.*Source: \[`benchmarks/results/(\w+)\.json`\].*$", page, flags=re.M)
    assert len(sources) >= 5
    for line in re.findall(r"^\*.*Source: .*$", page, flags=re.M):
        name = re.search(r"results/(\w+)\.json", line).group(1)
        p = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["provenance"]
        assert f"commit `{p['commit'][:7]}`" in line, name
        flag = {True: "with uncommitted changes", False: "without uncommitted changes",
                None: "uncommitted changes not recorded"}[p["uncommitted_changes"]]
        assert flag in line, name
        assert ("tree_commit" in p) == (f"`{p.get('tree_commit', '')[:7]}`'s" in line), name


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_the_engine_hash_follows_the_files_not_their_place(tmp_path):
    for package in ("jaxmtp", "pallas_kernels"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    (tmp_path / "jaxmtp" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "jaxmtp" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"bytecode")
    assert engine_sha256(str(tmp_path)) == engine_sha256(str(ROOT))
    with open(tmp_path / "pallas_kernels" / "reference.py", "a") as f:
        f.write("\n")
    assert engine_sha256(str(tmp_path)) != engine_sha256(str(ROOT))


def test_the_engine_changed_since_a_result_by_its_hash_or_by_git():
    render = _render()
    assert not render.engine_changed({"engine_sha256": engine_sha256(str(ROOT)), "commit": "0" * 40})
    assert render.engine_changed({"engine_sha256": "0" * 64, "commit": "0" * 40})
    try:
        touched = _git("log", "-1", "--format=%H", "--", "jaxmtp")  # the last commit that changed jaxmtp/
        before = _git("rev-parse", f"{touched}^")
    except subprocess.CalledProcessError:
        pytest.skip("needs the repository's history (a full clone)")
    assert render.engine_changed({"commit": before})
    assert render.engine_changed({"commit": touched, "tree_commit": before}), "the tree's commit is compared"
    if not _git("status", "--porcelain", "--", "jaxmtp", "pallas_kernels"):
        assert not render.engine_changed({"commit": _git("rev-parse", "HEAD")})
    with pytest.raises(LookupError, match="commit " + "1" * 40):
        render.engine_changed({"commit": "1" * 40})


def test_measured_at_says_the_flag_and_the_tree():
    render = _render()
    same = {"engine_sha256": engine_sha256(str(ROOT)), "commit": "a" * 40}
    assert render.measured_at({**same, "uncommitted_changes": None}) == (
        f"Measured at commit `{'a' * 7}`, uncommitted changes not recorded.")
    text = render.measured_at({**same, "uncommitted_changes": True, "tree_commit": "b" * 40, "tree_reason": "r"})
    assert f"`{'a' * 7}`" in text and f"`{'b' * 7}`'s" in text and "with uncommitted changes" in text
    changed = render.measured_at({**same, "engine_sha256": "0" * 64, "uncommitted_changes": False})
    assert changed.endswith("without uncommitted changes; the engine (`jaxmtp/`, `pallas_kernels/`) has changed since.")


def test_prompt_labels_say_which_text_prompted():
    render = _render()
    shipped = hashlib.sha256(pathlib.Path(data.BENCHMARK_PROMPTS).read_bytes()).hexdigest()
    current = {"benchmark": "bench", "figures": {"prompts_sha256": shipped}, "provenance": {"engine_sha256": "e"}}
    assert render.prompts_label(current, "8 prompts") == (
        f"8 prompts (`jaxmtp/benchmark_prompts.json`, sha256 `{shipped[:12]}`)")
    given = {**current, "figures": {"prompts": "--tokens", "prompts_sha256": "f" * 64}}
    assert render.prompts_label(given, "--tokens").startswith("prompts given as token ids")
    earlier = {**current, "figures": {"prompts_sha256": "f" * 64}}
    assert "an earlier version of `jaxmtp/benchmark_prompts.json`" in render.prompts_label(earlier, "8 prompts")
    legacy = {"benchmark": "bench", "figures": {}, "provenance": {"versions": {"python": "3.11.7"}}}
    assert "cut from Python 3.11.7's standard library before" in render.prompts_label(legacy, "8 prompts")
    legacy["provenance"]["versions"] = {}
    assert "its version not recorded" in render.prompts_label(legacy, "8 prompts")
    with pytest.raises(ValueError, match="prompts_sha256"):
        render.prompts_label({**current, "figures": {}}, "8 prompts")

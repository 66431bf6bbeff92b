"""docs/performance.md and the README's results table are what benchmarks/render.py renders from
the results JSON now, and every results file carries its provenance."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _render():
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_page_and_readme_table_are_rendered_from_the_results():
    render = _render()
    assert (ROOT / "docs" / "performance.md").read_text() == render.page(), "run python benchmarks/render.py"
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

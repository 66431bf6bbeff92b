"""The pages in docs/: every ```python block runs, docs/cli.md is what tools/render_cli.py renders
from the command line's parser, and every relative link points to a file that exists.

The python blocks of one page run in one fresh interpreter, in order (later blocks use the names of
earlier ones), in an empty temporary working directory, so that they depend on neither the working
directory nor the test process. They share the test process's cache directory (compiled programs
and auto's round costs), so a program that one page or test compiled loads in the next.
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# A fenced block: its opening fence's language and its body (fences start at the line's start).
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
# [text](target), the target up to a closing parenthesis or a title; and [label]: target.
LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# Runs a page's python blocks in one namespace; each block compiled at its own lines of the page,
# so that a traceback names the page and line.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
path = sys.argv[1]
for line, source in json.loads(sys.argv[2]):
    exec(compile("\\n" * (line - 1) + source, path, "exec"), namespace)
"""


def _blocks(page: pathlib.Path) -> list[tuple[str, int, str]]:
    """(language, line of the block's first line in the page, body) of each fenced block."""
    text = page.read_text()
    return [(m[1].strip(), text.count("\n", 0, m.start(2)) + 1, m[2]) for m in FENCE.finditer(text)]


def _python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    return [(line, body) for language, line, body in _blocks(page) if language == "python"]


RUNNABLE = [page for page in PAGES if _python_blocks(page)]
# Pages whose blocks' calls tests elsewhere run, which the suite's time budget leaves to
# JAXMTP_LONG_TESTS=1 (page -> the tests that run them).
LONG_PAGES = {"training.md": "tests/test_train.py runs its training and MTP-only fine-tuning",
              "deepseek_v4.md": "tests/test_deepseek_v4.py runs its generate, sampling and stream calls",
              "serving.md": "tests/test_engine.py runs its Engine calls",
              "speculative_decoding.md": "tests/test_generate.py and tests/test_streaming.py make its generate "
                                         "(k, auto, sampling, stops, GenerationConfig) and stream calls on test models",
              "fp8_and_kernels.md": "tests/test_fp8_gemm.py, test_fp8_model.py and test_fp8_checkpoint.py make its "
                                    "quantize, kernel and kept-weight calls"}


@pytest.fixture(scope="session")
def docs_cache() -> pathlib.Path:
    """The test run's cache directory (tests/conftest.py): compiled programs and round costs,
    shared with the other tests, the README's and the notebook's included."""
    return pathlib.Path(os.environ["JAXMTP_CACHE_DIR"])


def test_pages_exist():
    assert {"getting_started.md", "cli.md"} <= {page.name for page in PAGES}
    assert RUNNABLE


@pytest.mark.parametrize("page", [
    pytest.param(page, marks=pytest.mark.skipif(page.name in LONG_PAGES and not os.environ.get("JAXMTP_LONG_TESTS"),
                                                reason=f"{LONG_PAGES.get(page.name)}; set "
                                                       "JAXMTP_LONG_TESTS=1 to run it")) for page in RUNNABLE],
    ids=lambda page: page.name)
def test_python_blocks_run(page, docs_cache, tmp_path):
    blocks = _python_blocks(page)
    env = dict(os.environ, JAXMTP_CACHE_DIR=str(docs_cache), JAXMTP_COMPILE_CACHE=str(docs_cache / "xla"),
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    run = subprocess.run([sys.executable, "-c", RUNNER, str(page.relative_to(ROOT)), json.dumps(blocks)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{page.name}: a python block failed\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"


def test_every_python_like_block_is_run():
    """Blocks that cannot run in a test (a real checkpoint, several hosts, a GPU) are ```text or
    ```bash; a python block under another name (```py, ```python3, ```python-skip) or with an
    indented fence would be skipped silently."""
    hidden = [f"{page.name}:{line}: ```{language}" for page in PAGES for language, line, _ in _blocks(page)
              if language != "python" and language.lower().startswith("py")]
    hidden += [f"{page.name}:{number}: an indented fence" for page in PAGES
               for number, text in enumerate(page.read_text().splitlines(), 1) if re.match(r"\s+```\s*py", text)]
    assert not hidden, "python blocks that the tests would not run:\n" + "\n".join(hidden)


def test_cli_page_is_current():
    spec = importlib.util.spec_from_file_location("render_cli", ROOT / "tools" / "render_cli.py")
    render_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_cli)
    assert (DOCS / "cli.md").read_text() == render_cli.render(), (
        "docs/cli.md is stale: run python tools/render_cli.py")


def test_relative_links_point_to_files():
    broken = set()
    for page in PAGES:
        # Links inside code blocks and code spans are code, not links.
        text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
        for target in (inline or label for inline, label in LINK.findall(text)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # a URL or an anchor
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.add(f"{page.name}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(sorted(broken))

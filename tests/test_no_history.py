"""The sources and docs name no commits: a commit hash in a comment or docstring is history that ages.

Results under benchmarks/results/ keep the commit they were measured at (their provenance), and so
do the footnotes benchmarks/render.py renders from them (docs/performance.md and the README's results
block); CHANGELOG.md is history by design. These are left out.
"""

import json
import pathlib
import re
import string

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Scanned whole (every text file under a directory).
SCANNED = ("README.md", "docs", "jaxmtp", "pallas_kernels", "tools", "tests", "notebooks")
# Scanned only for these suffixes.
BENCHMARKS, BENCHMARK_SUFFIXES = "benchmarks", (".py", ".sh", ".md")
EXCLUDED_DIRS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
EXCLUDED = ("benchmarks/results/", "docs/performance.md")
# The README's block that benchmarks/render.py writes (its markers).
RENDERED = re.compile(r"<!-- results: rendered by benchmarks/render.py -->.*?<!-- end of results -->", re.S)
# A whole word of 7-40 lowercase hex digits with at least one digit and one letter a-f: the shape of
# an abbreviated or full commit hash. A word touching letters, digits or "_" on either side is not
# one, so hex constants written "0x..." and longer digests (sha256) do not match.
HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
# A notebook cell's own id (random hex that Jupyter writes), not a reference to anything.
NOTEBOOK_CELL_ID = re.compile(r'^\s*"id":\s*"[0-9a-f-]+",?\s*$')


def _files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.is_file())
    benchmarks = ROOT / BENCHMARKS
    if benchmarks.is_dir():
        yield from (p for p in sorted(benchmarks.rglob("*")) if p.is_file() and p.suffix in BENCHMARK_SUFFIXES)


def _scanned(path: pathlib.Path) -> bool:
    relative = path.relative_to(ROOT).as_posix()
    return (path.name != "CHANGELOG.md" and not relative.startswith(EXCLUDED)
            and not EXCLUDED_DIRS.intersection(path.relative_to(ROOT).parts))


def _text(path: pathlib.Path) -> str | None:
    """The file's text, or None for a binary file (weights, bytecode)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def offenders() -> list[str]:
    """'file:line: tokens' for every line of the scanned files with a commit-hash-like token."""
    out = []
    for path in _files():
        if not _scanned(path):
            continue
        text = _text(path)
        if text is None:
            continue
        if path == ROOT / "README.md":
            text = RENDERED.sub(lambda m: "\n" * m.group().count("\n"), text)  # same line numbers after it
        notebook = path.suffix == ".ipynb"
        for number, line in enumerate(text.splitlines(), 1):
            if notebook and NOTEBOOK_CELL_ID.match(line):
                continue
            tokens = sorted(set(HASH.findall(line)))
            if tokens:
                out.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {', '.join(tokens)}")
    return out


def test_rule_matches_hashes_only():
    # Examples are split or computed so that this file itself holds no hash-like word.
    hexdigits = string.hexdigits[:16]
    for word in ["6b1" "65ac", "479" "f24b", hexdigits * 2 + "01234567"]:
        assert HASH.fullmatch(word), word
    for word in ["deadbeef", "1234567", "0x7fffff", "0x7FFFFF", "6B1" "65AC", "abc123", "e4m3fn",
                 "_6b1" "65ac", hexdigits * 4]:
        assert not HASH.search(word), word
    assert HASH.findall("--base " + "6b1" "65ac" + ")") == ["6b1" "65ac"]
    assert NOTEBOOK_CELL_ID.match(json.dumps({"id": "62b" "c13ff"})[1:-1])


def test_no_commit_hashes():
    found = offenders()
    assert not found, ("commit-hash-like tokens (name the benchmark or describe the change instead; results "
                       "under benchmarks/results/ keep their provenance):\n" + "\n".join(found))

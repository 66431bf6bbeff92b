"""Every Python block of README.md runs as written, from any working directory."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
BLOCKS = re.findall(r"^```python\n(.*?)^```", open(README).read(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths in the README must not depend on the working directory
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})

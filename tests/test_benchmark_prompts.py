"""The benchmarks' held-out prompts are the excerpts shipped with the package: the same text
whichever Python runs them, cut from modules the demo model was not trained on, installed with the
package, and named by their hash in bench's results."""

import fnmatch
import hashlib
import json
import os
import pathlib
import platform
import sysconfig
import tomllib

import pytest
from tokenizers import Tokenizer

import jaxmtp
from jaxmtp import InputError, data

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = json.loads(pathlib.Path(data.BENCHMARK_PROMPTS).read_text())


def _tokenizer():
    return Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))


def test_the_excerpts_come_from_held_out_modules_with_their_source_and_license():
    assert len(SHIPPED["excerpts"]) == len(data.HELD_OUT_MODULES)
    for excerpt in SHIPPED["excerpts"]:
        assert excerpt["file"].split("/")[0].removesuffix(".py") in data.HELD_OUT_MODULES, excerpt["file"]
        first, last = excerpt["lines"]
        assert excerpt["text"].count("\n") == last - first + 1, excerpt["file"]
    assert "CPython" in SHIPPED["source"] and "Python Software Foundation" in SHIPPED["license"]
    assert len(pathlib.Path(data.BENCHMARK_PROMPTS).read_bytes()) < 32_000, "a small excerpt"


def test_the_excerpts_are_the_standard_librarys_lines_unmodified():
    python = SHIPPED["source"].split(",")[0].removeprefix("CPython ")
    if platform.python_version() != python:
        pytest.skip(f"the excerpts are CPython {python}'s; this is {platform.python_version()}")
    root = sysconfig.get_paths()["stdlib"]
    for excerpt in SHIPPED["excerpts"]:
        first, last = excerpt["lines"]
        with open(os.path.join(root, excerpt["file"]), encoding="utf-8") as f:
            assert "".join(f.readlines()[first - 1:last]) == excerpt["text"], excerpt["file"]


def test_held_out_prompts_are_cut_from_the_shipped_text_only():
    tokenizer = _tokenizer()
    text = "".join(excerpt["text"] for excerpt in SHIPPED["excerpts"])
    prompts = data.held_out_prompts(tokenizer, count=8, length=32)
    assert len(prompts) == 8 and all(len(p) == 32 for p in prompts)
    stream = tokenizer.encode(data.END_OF_TEXT.join(e["text"] for e in SHIPPED["excerpts"])).ids
    for prompt in prompts:
        decoded = tokenizer.decode(prompt, skip_special_tokens=False)
        pieces = [piece for piece in decoded.split(data.END_OF_TEXT) if piece]
        assert all(piece in text for piece in pieces), decoded  # text of the excerpts, across their boundaries
        assert any(stream[i:i + 32] == prompt for i in range(len(stream) - 31)), decoded
    assert data.held_out_prompts(tokenizer, count=8, length=32) == prompts


def test_held_out_prompts_refuse_more_tokens_than_the_text_holds():
    tokens = len(data.encode(_tokenizer(), data.benchmark_texts()))
    with pytest.raises(InputError, match=f"length {tokens}: the shipped prompts hold {tokens} tokens"):
        data.held_out_prompts(_tokenizer(), count=1, length=tokens)
    with pytest.raises(InputError, match="count 0"):
        data.held_out_prompts(_tokenizer(), count=0, length=8)


def test_the_prompts_hash_is_the_files_and_the_file_is_package_data():
    assert data.prompts_sha256() == hashlib.sha256(pathlib.Path(data.BENCHMARK_PROMPTS).read_bytes()).hexdigest()
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["jaxmtp"]
    relative = os.path.relpath(data.BENCHMARK_PROMPTS, os.path.dirname(jaxmtp.__file__))
    assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), (relative, patterns)

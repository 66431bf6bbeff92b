"""Training text for the demo model: the Python standard library's source and a BPE tokenizer for it.

The source is already on every machine that runs Python; the tokenizer is byte-level BPE trained on
it. Test suites are left out; a fixed set of modules is held out for evaluation. The benchmarks'
prompts come from excerpts of those held-out modules shipped with the package
(benchmark_prompts.json), so that they are the same text whichever Python runs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import sysconfig
from typing import Any

import numpy as np

from jaxmtp.errors import InputError

# Modules (files or packages at the top of the standard library) kept out of training.
HELD_OUT_MODULES = ("bisect", "calendar", "csv", "difflib", "fnmatch", "fractions", "glob", "heapq", "json",
                    "shlex", "statistics", "textwrap")
END_OF_TEXT = "<|endoftext|>"
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
# Excerpts of the held-out modules' source (one Python's, named in the file with its license).
BENCHMARK_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark_prompts.json")


def source_files(root: str | None = None) -> tuple[list[str], list[str]]:
    """-> (training files, held-out files): sorted *.py paths of the standard library, tests excluded."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, held_out = [], []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = os.path.join(directory, name)
            top = os.path.relpath(path, root).split(os.sep)[0].removesuffix(".py")
            (held_out if top in HELD_OUT_MODULES else train).append(path)
    return train, held_out


def read(files: list[str]) -> list[str]:
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (HF `tokenizers`); id 0 is END_OF_TEXT, which separates files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one int32 stream, each followed by END_OF_TEXT."""
    eos = tokenizer.token_to_id(END_OF_TEXT)
    ids = [np.append(np.asarray(e.ids, np.int32), eos) for e in tokenizer.encode_batch(texts)]
    return np.concatenate(ids).astype(np.int32)


def windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` random windows of `length` consecutive tokens: [batch, length] int32."""
    starts = rng.integers(0, len(tokens) - length, batch)
    return np.stack([tokens[s:s + length] for s in starts])


def prompts_from(tokens: np.ndarray, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens taken at evenly spaced offsets of a token stream."""
    starts = np.linspace(0, len(tokens) - length - 1, count).astype(int)
    return [tokens[s:s + length].tolist() for s in starts]


def held_out_tokens(tokenizer) -> np.ndarray:
    """The held-out modules' source (HELD_OUT_MODULES) as one token stream (see `encode`)."""
    return encode(tokenizer, read(source_files()[1]))


def benchmark_texts() -> list[str]:
    """The shipped excerpts of the held-out modules (BENCHMARK_PROMPTS), in the file's order."""
    with open(BENCHMARK_PROMPTS, encoding="utf-8") as f:
        return [excerpt["text"] for excerpt in json.load(f)["excerpts"]]


def prompts_sha256() -> str:
    """sha256 of the shipped prompts file, which results record beside the figures it prompted."""
    with open(BENCHMARK_PROMPTS, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def held_out_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from the shipped held-out excerpts (`benchmark_texts`,
    encoded as by `encode`, cut as by `prompts_from`): text the demo model was not trained on, the
    same on every machine, as the benchmarks and tests prompt it with."""
    tokens = encode(tokenizer, benchmark_texts())
    if count < 1 or not 1 <= length < len(tokens):
        raise InputError(f"held_out_prompts: count {count} and length {length}: the shipped prompts hold "
                         f"{len(tokens)} tokens in this tokenizer; expected count >= 1 and 1 <= length < {len(tokens)}")
    return prompts_from(tokens, count, length)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The standard library's source encoded for training. tokenizer: a `tokenizers.Tokenizer`;
    train, held_out: token streams (see `encode`); train_files: how many files `train` holds."""

    tokenizer: Any
    train: np.ndarray
    held_out: np.ndarray
    train_files: int

    @classmethod
    def read(cls, tokenizer=None, vocab_size: int | None = None) -> Corpus:
        """Reads and encodes the source with `tokenizer`, or with a BPE tokenizer of `vocab_size`
        trained on the training files."""
        train_texts, held_texts = (read(files) for files in source_files())
        tokenizer = tokenizer or train_tokenizer(train_texts, vocab_size)
        return cls(tokenizer, encode(tokenizer, train_texts), encode(tokenizer, held_texts), len(train_texts))

    def summary(self) -> dict:
        """What a training run read, for its record."""
        return {"source": "Python standard library *.py (tests excluded)", "python": sys.version.split()[0],
                "training_files": self.train_files, "training_tokens": int(len(self.train)),
                "held_out_modules": list(HELD_OUT_MODULES), "held_out_tokens": int(len(self.held_out))}

    def __str__(self) -> str:
        return (f"{self.train_files} training files, {len(self.train):,} tokens; held out "
                f"{', '.join(HELD_OUT_MODULES)}: {len(self.held_out):,} tokens")

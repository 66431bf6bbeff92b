"""Bad inputs: how jaxmtp answers the mistakes a new user makes.

Tries a fixed list of bad inputs through the public API (`generate`, `Model.forward`,
`Model.mtp_forward`, `ModelConfig.from_hf_config`, `load`, `save`) and the command line
(`python -m jaxmtp.cli`), and sorts each answer into one outcome class:

  clear         ValueError / TypeError raised by jaxmtp's own code, its message naming the
                argument, field or file; on the command line: exit status 2, no traceback, and
                stderr's last line naming the problem
  unclear       any other error: another type, a message that does not name the problem, or one
                raised from numpy, int() or the standard library
  crash in JAX  an error raised from inside jax / jaxlib / flax (tracing errors, XlaRuntimeError)
  silent        no error for an input that must be refused, or a wrong result (NaN logits, tokens
                past the EOS, token 0 forever)
  ok            worked where working is acceptable, and the output checked right
  data loss     a checkpoint write that damaged or mixed the checkpoint already there
  traceback     the command line printed a Python traceback
  setup failed  the case could not be set up against this checkout

Generation uses the bundled demo model (`jaxmtp.DEMO_MODEL`); configs and checkpoints start from
configs/tiny.json. The checkout under test is whichever `jaxmtp` Python imports (printed in the
header), so the same script surveys an earlier commit too:

    python benchmarks/bad_inputs.py [--json] [--only WORD]
    PYTHONPATH=/path/to/other/checkout python benchmarks/bad_inputs.py --json > before.json
    python benchmarks/bad_inputs.py --compare before.json after.json

About three minutes on two CPU cores; most of it compiling the generate calls that run.
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, NamedTuple

# JAX trims its own frames from tracebacks by default; they are what tells a crash inside JAX apart.
os.environ.setdefault("JAX_TRACEBACK_FILTERING", "off")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH's entries

import jax  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import jaxmtp  # noqa: E402

CLEAR, UNCLEAR, CRASH, SILENT, OK, DATA_LOSS, TRACEBACK, SETUP = (
    "clear", "unclear", "crash in JAX", "silent", "ok", "data loss", "traceback", "setup failed")
OUTCOMES = (CLEAR, OK, UNCLEAR, CRASH, TRACEBACK, SILENT, DATA_LOSS, SETUP)
JAX_PACKAGES = ("jax", "jaxlib", "flax")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxmtp.__file__)))
TINY = next(p for p in (os.path.join(ROOT, "configs", "tiny.json"),
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tiny.json"))
            if os.path.exists(p))
PROMPT = [[5, 6, 7]]
NEW = 4  # max_new_tokens unless the case is about it


class Case(NamedTuple):
    group: str
    name: str
    expected: str
    run: Callable[[], tuple[str, str]]  # -> (outcome, detail)


# ----- judging -------------------------------------------------------------------------------
def one_line(text, limit=160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def names(message: str, words) -> bool:
    """Every word appears in the message; "a|b" accepts either."""
    message = message.lower()
    return all(any(alt.lower() in message for alt in word.split("|")) for word in words)


def raising_package(error: BaseException) -> str:
    """The top-level package of the innermost Python frame of the error's traceback."""
    tb, module = error.__traceback__, ""
    while tb is not None:
        module, tb = tb.tb_frame.f_globals.get("__name__", ""), tb.tb_next
    return module.split(".")[0]


def judge(error: Exception, words) -> tuple[str, str]:
    where = raising_package(error)
    detail = one_line(f"{type(error).__name__}: {error} [{where}]")
    if where in JAX_PACKAGES:
        return CRASH, detail
    if isinstance(error, (ValueError, TypeError)) and where == "jaxmtp" and names(str(error), words):
        return CLEAR, detail
    return UNCLEAR, detail


def describe(result) -> str:
    if hasattr(result, "tokens"):
        return f"tokens {result.tokens}"
    if isinstance(result, tuple) and result and hasattr(result[0], "shape"):
        result = result[0]
    if hasattr(result, "shape"):
        array = np.asarray(result)
        return f"array {list(array.shape)}" + (" with NaN" if np.isnan(array).any() else "")
    return type(result).__name__


def refused(call, *words) -> tuple[str, str]:
    """An input that must be refused with a message naming `words`."""
    try:
        result = call()
    except Exception as error:
        return judge(error, words)
    return SILENT, one_line("no error: " + describe(result))


def acceptable(call, check, *words) -> tuple[str, str]:
    """An input that may work (then `check(result)` judges the output) or be refused clearly."""
    try:
        result = call()
    except Exception as error:
        return judge(error, words)
    return check(result)


# ----- shared models and files ---------------------------------------------------------------
@functools.lru_cache(None)
def work_dir() -> str:
    return tempfile.mkdtemp(prefix="jaxmtp_bad_inputs_")


def fresh(name="ckpt") -> str:
    """A path that does not exist yet, in a new folder of the work directory."""
    return os.path.join(tempfile.mkdtemp(dir=work_dir()), name)


@functools.lru_cache(None)
def demo():
    return jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)


@functools.lru_cache(None)
def reference(**kwargs) -> list[int]:
    """The demo model's new tokens for PROMPT with valid arguments (greedy, 8 tokens by default)."""
    return jaxmtp.generate(demo(), PROMPT, **{"max_new_tokens": 8, **kwargs}).tokens[0]


def tiny_config() -> dict:
    with open(TINY) as f:
        return json.load(f)


@functools.lru_cache(None)
def tiny(seed: int = 0):
    return jaxmtp.init(jaxmtp.ModelConfig.from_hf_config(TINY), seed=seed)


@functools.lru_cache(None)
def tiny_checkpoint() -> str:
    path = os.path.join(work_dir(), "tiny_hf")
    jaxmtp.save(tiny(0), path, format="hf")
    return path


def tiny_copy() -> str:
    path = fresh()
    shutil.copytree(tiny_checkpoint(), path)
    return path


def edit_json(file: str, edit):
    with open(file) as f:
        raw = json.load(f)
    with open(file, "w") as f:
        json.dump(edit(raw), f, indent=2)


def set_fields(**changes):
    return lambda raw: {**raw, **changes}


def edit_tensors(directory: str, edit):
    """Rewrites every safetensors file of `directory` as edit(name -> array) returns it."""
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            file = os.path.join(directory, name)
            save_file(edit(load_file(file)), file, metadata={"format": "pt"})


def digest(path: str) -> dict:
    """Relative file name -> sha1 of its bytes, for everything under `path` (a file or folder)."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": hashlib.sha1(f.read()).hexdigest()}
    out = {}
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), path)] = hashlib.sha1(f.read()).hexdigest()
    return out


def same_params(a, b) -> bool:
    left, right = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    return len(left) == len(right) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(left, right))


# ----- generate ------------------------------------------------------------------------------
def _gen(name, words, **kwargs) -> Case:
    """generate(demo, ...) must refuse; a callable argument is called with the model."""
    def run():
        model = demo()
        args = {"prompts": PROMPT, "max_new_tokens": NEW, **{k: v(model) if callable(v) else v for k, v in kwargs.items()}}
        return refused(lambda: jaxmtp.generate(model, **args), *words)
    return Case("generate", name, "refused: " + ", ".join(words), run)


def _numpy_prompts() -> Case:
    def run():
        model, want = demo(), reference()[:NEW]
        def check(out):
            return (OK, f"tokens {out.tokens}") if out.tokens == [want] else (SILENT, f"{out.tokens}, lists give {[want]}")
        return acceptable(lambda: jaxmtp.generate(model, np.array(PROMPT), max_new_tokens=NEW), check, "prompts")
    return Case("generate", "prompts=np.array([[5, 6, 7]])", "works as the list does, or refused", run)


def _top_k_above_vocab() -> Case:
    def run():
        model = demo()
        vocab = model.config.vocab_size
        want = reference(max_new_tokens=NEW, temperature=1.0, top_k=vocab)
        def check(out):
            got = out.tokens[0]
            if got == want:
                return OK, f"as top_k=vocab: {got}"
            return SILENT, ("token 0 forever" if not any(got) else f"{got}, top_k=vocab gives {want}")
        return acceptable(lambda: jaxmtp.generate(model, PROMPT, max_new_tokens=NEW, temperature=1.0, top_k=vocab + 100),
                          check, "top_k")
    return Case("generate", "top_k=vocab+100 (temperature 1)", "as top_k=vocab, or refused", run)


def _eos_list(k: int) -> Case:
    def run():
        model, ref = demo(), reference()
        eos = [ref[3], ref[1]]  # the first id occurs later than the second
        want = ref[:next(i for i, t in enumerate(ref) if t in eos) + 1]
        def check(out):
            got = out.tokens[0]
            return (OK, f"stops after {got[-1]}") if got == want else (SILENT, f"{got}, should stop at {want}")
        return acceptable(lambda: jaxmtp.generate(model, PROMPT, max_new_tokens=8, speculative_k=k, eos_token_id=eos),
                          check, "eos_token_id")
    return Case("generate", f"eos_token_id=[a, b], speculative_k={k}", "stops after the first of a, b", run)


def generate_cases() -> list[Case]:
    vocab = lambda m: m.config.vocab_size  # noqa: E731
    return [
        _gen("prompts=[[1.5, 6, 7]]", ["prompts"], prompts=[[1.5, 6, 7]]),
        _gen("prompts=[[1.0, 6, 7]]", ["prompts"], prompts=[[1.0, 6, 7]]),
        _gen('prompts=[["1", "2", "3"]]', ["prompts"], prompts=[["1", "2", "3"]]),
        _gen("prompts=[[5, None, 7]]", ["prompts"], prompts=[[5, None, 7]]),
        _gen("prompts=None", ["prompts"], prompts=None),
        _gen("prompts=[1, 2, 3] (flat)", ["prompts"], prompts=[1, 2, 3]),
        _numpy_prompts(),
        _gen("prompts=np.array([5, 6, 7]) (1-D)", ["prompts"], prompts=np.array([5, 6, 7])),
        _gen("prompts=[]", ["prompts"], prompts=[]),
        _gen("prompts=[[]]", ["prompts"], prompts=[[]]),
        _gen("prompts=[[5, vocab]]", ["prompts", "vocab"], prompts=lambda m: [[5, vocab(m)]]),
        _gen("prompts=[[5, -1]]", ["prompts", "vocab"], prompts=[[5, -1]]),
        _gen("max_new_tokens=2.5", ["max_new_tokens"], max_new_tokens=2.5),
        _gen('max_new_tokens="4"', ["max_new_tokens"], max_new_tokens="4"),
        _gen("max_new_tokens=0", ["max_new_tokens"], max_new_tokens=0),
        _gen("max_new_tokens=-1", ["max_new_tokens"], max_new_tokens=-1),
        _gen("max_new_tokens=None", ["max_new_tokens"], max_new_tokens=None),
        _gen("speculative_k=1.5", ["speculative_k"], speculative_k=1.5),
        _gen('speculative_k="2"', ["speculative_k"], speculative_k="2"),
        _gen("speculative_k=-1", ["speculative_k"], speculative_k=-1),
        _gen("speculative_k=99", ["speculative_k"], speculative_k=99),
        _gen("speculative_k=True", ["speculative_k"], speculative_k=True),
        _gen("temperature=nan", ["temperature"], temperature=float("nan")),
        _gen("temperature=-1", ["temperature"], temperature=-1.0),
        _gen("temperature=inf", ["temperature"], temperature=float("inf")),
        _gen('temperature="0.5"', ["temperature"], temperature="0.5"),
        _gen("top_p=0", ["top_p"], temperature=1.0, top_p=0.0),
        _gen("top_p=1.5", ["top_p"], temperature=1.0, top_p=1.5),
        _gen("top_p=nan", ["top_p"], temperature=1.0, top_p=float("nan")),
        _gen("top_k=-1", ["top_k"], temperature=1.0, top_k=-1),
        _gen("top_k=2.5", ["top_k"], temperature=1.0, top_k=2.5),
        _top_k_above_vocab(),
        _gen('seed="x"', ["seed"], seed="x"),
        _eos_list(0),
        _eos_list(1),
        _eos_list(2),
        _gen('eos_token_id="1"', ["eos_token_id"], eos_token_id="1"),
        _gen("eos_token_id=1.5", ["eos_token_id"], eos_token_id=1.5),
    ]


# ----- forward and mtp_forward ---------------------------------------------------------------
def _forward(name, tokens, *words) -> Case:
    def run():
        model = demo()
        return refused(lambda: model.forward(tokens(model) if callable(tokens) else tokens), *words)
    return Case("forward", name, "refused: " + ", ".join(words), run)


def _forward_flat() -> Case:
    def run():
        model = demo()
        want = np.asarray(model.forward(PROMPT)[0])
        def check(out):
            got = np.asarray(out[0])
            if got.size == want.size and np.allclose(got.reshape(want.shape), want, atol=1e-5):
                return OK, f"logits {list(got.shape)}, as [[5, 6, 7]]"
            return SILENT, f"logits {list(got.shape)}, unlike [[5, 6, 7]]'s {list(want.shape)}"
        return acceptable(lambda: model.forward(PROMPT[0]), check, "tokens")
    return Case("forward", "forward([5, 6, 7]) (1-D)", "works as one row, or refused", run)


def _mtp(name, make, *words) -> Case:
    """mtp_forward(*make(model, hidden)) with hidden = forward(PROMPT)'s, must refuse."""
    def run():
        model = demo()
        hidden = model.forward(PROMPT)[1]
        args = make(model, hidden)
        return refused(lambda: model.mtp_forward(*args), *words)
    return Case("forward", name, "refused: " + ", ".join(words), run)


def forward_cases() -> list[Case]:
    return [
        _forward("tokens=[[5, vocab]]", lambda m: [[5, m.config.vocab_size]], "token", "vocab"),
        _forward("tokens=[[5, -1]]", [[5, -1]], "token", "vocab"),
        _forward("tokens=[[1.5, 2.0]]", [[1.5, 2.0]], "token"),
        _forward_flat(),
        _forward("tokens=[[[5, 6, 7]]] (3-D)", [[[5, 6, 7]]], "tokens"),
        _mtp("mtp_forward: batch 1 hidden, batch 2 next_tokens", lambda m, h: (h, [[8, 9, 10], [8, 9, 10]]),
             "hidden", "next_tokens"),
        _mtp("mtp_forward: length 3 hidden, length 4 next_tokens", lambda m, h: (h, [[8, 9, 10, 11]]),
             "hidden", "next_tokens"),
        _mtp("mtp_forward: hidden one wider than hidden_size", lambda m, h: (np.pad(np.asarray(h), ((0, 0), (0, 0), (0, 1))),
                                                                            [[8, 9, 10]]), "hidden"),
        _mtp("mtp_forward: next_tokens=[[8, 9, vocab]]", lambda m, h: (h, [[8, 9, m.config.vocab_size]]),
             "token", "vocab"),
    ]


# ----- configs -------------------------------------------------------------------------------
def _config(name, edit, *words, text=None) -> Case:
    """from_hf_config(a config.json = edit(tiny.json), or `text` as is) must refuse."""
    def run():
        path = fresh("config.json")
        with open(path, "w") as f:
            f.write(text if text is not None else json.dumps(edit(tiny_config())))
        return refused(lambda: jaxmtp.ModelConfig.from_hf_config(path), *words)
    return Case("config", name, "refused: " + ", ".join(words), run)


def _config_dtype() -> Case:
    def run():
        path = fresh("config.json")
        with open(path, "w") as f:
            json.dump({**tiny_config(), "dtype": "float33"}, f)
        return acceptable(lambda: jaxmtp.ModelConfig.from_hf_config(path), lambda c: (OK, "accepted (no dtype field)"),
                          "dtype")
    return Case("config", 'dtype: "float33"', "refused: dtype; or ignored", run)


def _config_path(name, make, *words) -> Case:
    def run():
        path = make()
        return refused(lambda: jaxmtp.ModelConfig.from_hf_config(path), *words)
    return Case("config", name, "refused: " + ", ".join(words), run)


def _without(*fields):
    return lambda raw: {k: v for k, v in raw.items() if k not in fields}


def config_cases() -> list[Case]:
    def empty_dir():
        path = fresh("empty")
        os.makedirs(path)
        return path
    return [
        _config('num_hidden_layers: "10"', set_fields(num_hidden_layers="10"), "num_hidden_layers"),
        _config("hidden_size: 64.5", set_fields(hidden_size=64.5), "hidden_size"),
        _config("vocab_size: -1", set_fields(vocab_size=-1), "vocab_size"),
        _config("num_attention_heads: 0", set_fields(num_attention_heads=0), "num_attention_heads"),
        _config('max_position_embeddings: "2048"', set_fields(max_position_embeddings="2048"), "max_position_embeddings"),
        _config('rms_norm_eps: "1e-6"', set_fields(rms_norm_eps="1e-6"), "rms_norm_eps"),
        _config('tie_word_embeddings: "false"', set_fields(tie_word_embeddings="false"), "tie_word_embeddings"),
        _config("n_routed_experts: null", set_fields(n_routed_experts=None), "n_routed_experts"),
        _config("num_experts_per_tok: 99", set_fields(num_experts_per_tok=99), "num_experts_per_tok"),
        _config('rope_scaling: "yarn" (no rope_parameters)', lambda raw: {**_without("rope_parameters")(raw),
                                                                         "rope_scaling": "yarn"}, "rope_scaling"),
        _config('eos_token_id: "x"', set_fields(eos_token_id="x"), "eos_token_id"),
        _config('model_type: "llama"', set_fields(model_type="llama"), "model_type"),
        _config("config.json is a JSON list", lambda raw: [raw], "config.json"),
        _config("config.json is not JSON", None, "config.json", text='{"vocab_size": 512,'),
        _config_dtype(),
        _config_path("missing file", lambda: fresh("nonexistent.json"), "nonexistent.json"),
        _config_path("directory without config.json", empty_dir, "config.json"),
    ]


# ----- reading checkpoints -------------------------------------------------------------------
def _checkpoint(name, damage, *words, load=None) -> Case:
    """A copy of the tiny hf checkpoint, damaged by damage(dir); load(dir) (default jaxmtp.load)
    must refuse."""
    def run():
        path = tiny_copy()
        damage(path)
        return refused(lambda: (load or default_load)(path), *words)
    return Case("checkpoint", name, "refused: " + ", ".join(words), run)


def default_load(path):
    return jaxmtp.load(path, quiet=True)


def config_field(**changes):
    return lambda path: edit_json(os.path.join(path, "config.json"), set_fields(**changes))


def drop_mtp(path):
    layer = f"model.layers.{tiny_config()['num_hidden_layers']}."
    edit_tensors(path, lambda tensors: {k: v for k, v in tensors.items() if not k.startswith(layer)})
    edit_json(os.path.join(path, "model.safetensors.index.json"), lambda raw: {
        **raw, "weight_map": {k: v for k, v in raw["weight_map"].items() if not k.startswith(layer)}})


def nan_norm(path):
    edit_tensors(path, lambda tensors: {**tensors, "model.norm.weight": np.full_like(tensors["model.norm.weight"], np.nan)})


def transposed_embedding(path):
    name = "model.embed_tokens.weight"
    edit_tensors(path, lambda tensors: {**tensors, name: np.ascontiguousarray(tensors[name].T)})


def truncate(path):
    file = os.path.join(path, "model-00001-of-00001.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)


def index_names_missing_file(path):
    def edit(raw):
        first = next(iter(raw["weight_map"]))
        return {**raw, "weight_map": {**raw["weight_map"], first: "model-00002-of-00002.safetensors"}}
    edit_json(os.path.join(path, "model.safetensors.index.json"), edit)


def bin_only(path):
    for name in os.listdir(path):
        if name != "config.json":
            os.remove(os.path.join(path, name))
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        f.write(b"PK\x03\x04 not really a torch file")


def load_and_generate(path):
    return jaxmtp.generate(default_load(path), PROMPT, max_new_tokens=NEW)


def checkpoint_cases() -> list[Case]:
    return [
        _checkpoint("config n_routed_experts 8 -> 16", config_field(n_routed_experts=16), "n_routed_experts"),
        _checkpoint("config hidden_size 64 -> 96", config_field(hidden_size=96), "hidden_size"),
        _checkpoint("config num_hidden_layers 4 -> 5", config_field(num_hidden_layers=5), "num_hidden_layers"),
        _checkpoint("config vocab_size 512 -> 1024", config_field(vocab_size=1024), "vocab_size"),
        _checkpoint("MTP tensors missing, num_nextn_predict_layers: 1", drop_mtp, "MTP|nextn", "num_nextn_predict_layers"),
        _checkpoint("NaN in model.norm.weight: load + generate", nan_norm, "model.norm.weight", load=load_and_generate),
        _checkpoint("NaN in model.norm.weight: load(check_finite=True)", nan_norm, "model.norm.weight",
                    load=lambda path: jaxmtp.load(path, quiet=True, check_finite=True)),
        _checkpoint("embed_tokens stored transposed", transposed_embedding, "model.embed_tokens.weight"),
        _checkpoint("safetensors file truncated", truncate, "model-00001-of-00001.safetensors"),
        _checkpoint("index names a missing file", index_names_missing_file, "model-00002-of-00002.safetensors"),
        _checkpoint("pytorch_model.bin only", bin_only, "pytorch_model.bin|safetensors"),
        _checkpoint('config dtype: "float33"', config_field(dtype="float33"), "dtype"),
        _checkpoint('load(dir, dtype="float33")', lambda path: None, "dtype",
                    load=lambda path: jaxmtp.load(path, dtype="float33", quiet=True)),
        _checkpoint("load(a directory that does not exist)", lambda path: shutil.rmtree(path), "ckpt"),
        _checkpoint("load(config.json) (a file)", lambda path: None, "config.json",
                    load=lambda path: default_load(os.path.join(path, "config.json"))),
    ]


# ----- writing checkpoints -------------------------------------------------------------------
def _overwrite(old: str, new: str) -> Case:
    """save(model, dir, format=new) where dir holds another model's `old` checkpoint."""
    def run():
        path = fresh()
        jaxmtp.save(tiny(1), path, format=old)
        before = digest(path)
        try:
            jaxmtp.save(tiny(0), path, format=new)
        except Exception as error:
            if digest(path) != before:
                return DATA_LOSS, one_line(f"refused after changing the old checkpoint: {error}")
            return judge(error, ["ckpt|overwrite|exist|empty"])
        try:
            loaded = default_load(path)
        except Exception as error:
            return DATA_LOSS, one_line(f"saved; the directory no longer loads: {type(error).__name__}: {error}")
        if same_params(loaded, tiny(1)):
            return DATA_LOSS, "saved, yet load reads the old weights"
        if same_params(loaded, tiny(0)):
            return SILENT, "overwrote without asking"
        return DATA_LOSS, "load reads a mix of both"
    return Case("save", f"{new} save into a directory holding an {old} checkpoint", "refused, old one untouched", run)


def _save_onto_file() -> Case:
    def run():
        path = fresh("notes.txt")
        with open(path, "w") as f:
            f.write("not a checkpoint\n")
        before = digest(path)
        outcome = refused(lambda: jaxmtp.save(tiny(0), path, format="hf"), "notes.txt")
        return (DATA_LOSS, "the file was changed") if digest(path) != before else outcome
    return Case("save", "save(model, path of an existing file)", "refused: the path", run)


def _save_format() -> Case:
    def run():
        model, path = tiny(0), fresh()
        return refused(lambda: jaxmtp.save(model, path, format="safetensors"), "format")
    return Case("save", 'save(format="safetensors")', "refused: format", run)


def save_cases() -> list[Case]:
    return [_overwrite("hf", "hf"), _overwrite("orbax", "hf"), _overwrite("hf", "orbax"),
            _overwrite("orbax", "orbax"), _save_onto_file(), _save_format()]


# ----- command line --------------------------------------------------------------------------
def cli(args, timeout=90):
    """`python -m jaxmtp.cli args` from a new temp directory, importing the jaxmtp under test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               JAXMTP_CACHE_DIR=os.path.join(work_dir(), "cache"))
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxmtp.cli", *args], cwd=tempfile.mkdtemp(dir=work_dir()),
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start
    return proc, time.perf_counter() - start


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def cli_outcome(proc, seconds, words) -> tuple[str, str]:
    if proc is None:
        return UNCLEAR, f"still running after {seconds:.0f} s"
    line = last_line(proc.stderr)
    if "Traceback" in proc.stderr:
        return TRACEBACK, one_line(line)
    if proc.returncode == 0:
        return SILENT, one_line(f"exit 0: {last_line(proc.stdout)}")
    if proc.returncode == 2 and names(line, words):
        return CLEAR, one_line(line)
    return UNCLEAR, one_line(f"exit {proc.returncode}: {line}")


GEN = ["generate", "--tokens", "5,6,7", "--max-new-tokens", str(NEW), "--k", "0", "--quiet"]


def _cli(name, args, *words) -> Case:
    """`jaxmtp args` must exit 2 naming `words`; a callable args is called for the argument list."""
    def run():
        proc, seconds = cli(args() if callable(args) else args)
        return cli_outcome(proc, seconds, words)
    return Case("cli", name, "exit 2: " + ", ".join(words), run)


def _cli_bench_plot() -> Case:
    def run():
        proc, seconds = cli(["bench", "--plot", "/nonexistent_dir/x.png", "--repeats", "1", "--prompts", "1"], 30)
        outcome, detail = cli_outcome(proc, seconds, ["plot|nonexistent_dir"])
        if outcome == CLEAR and seconds > 15:
            return UNCLEAR, f"after {seconds:.0f} s (the benchmark ran first): {detail}"
        return outcome, detail
    return Case("cli", "bench --plot /nonexistent_dir/x.png", "exit 2 within 15 s: plot", run)


def _cli_train() -> Case:
    def run():
        out = fresh("x")
        outcome, detail = cli_outcome(*cli(["train", "--steps", "0", "--out", out], 60), ["steps"])
        if os.path.exists(out):
            return (UNCLEAR if outcome == CLEAR else outcome), detail + f" ({os.path.basename(out)} created)"
        return outcome, detail
    return Case("cli", "train --steps 0 --out <tmp>/x", "exit 2: steps; x not created", run)


def _cli_convert() -> Case:
    def run():
        dst = tiny_copy()
        before = digest(dst)
        outcome, detail = cli_outcome(*cli(["convert", jaxmtp.DEMO_MODEL, dst, "--format", "hf"]),
                                      ["ckpt|exist|empty|overwrite"])
        if digest(dst) != before and outcome != SILENT:
            return DATA_LOSS, "the old checkpoint changed: " + detail
        return outcome, ("overwrote without asking: " + detail) if outcome == SILENT else detail
    return Case("cli", "convert <demo> <dir holding a checkpoint> --format hf", "exit 2, old one untouched", run)


def _cli_forward_anywhere() -> Case:
    def run():
        proc, seconds = cli(["forward", "--tokens", "1,2,3"])
        if proc is not None and proc.returncode == 0:
            return OK, one_line(last_line(proc.stdout))
        return cli_outcome(proc, seconds, ["config"])
    return Case("cli", "forward --tokens 1,2,3 (from another directory)", "works: exit 0", run)


def _bad_config_dir() -> list[str]:
    path = tiny_copy()
    config_field(num_hidden_layers="4")(path)
    return [*GEN, "--model", path]


def cli_cases() -> list[Case]:
    return [
        _cli("generate --tokens 1,a", [*GEN, "--tokens", "1,a"], "tokens"),
        _cli('generate --tokens ""', [*GEN, "--tokens", ""], "tokens"),
        _cli("generate --k x", [*GEN, "--k", "x"], "--k"),
        _cli("generate --k -1", [*GEN, "--k", "-1"], "--k|speculative_k"),
        _cli("generate --max-new-tokens 0", [*GEN, "--max-new-tokens", "0"], "max-new-tokens|max_new_tokens"),
        _cli("generate --temperature nan", [*GEN, "--temperature", "nan"], "temperature"),
        _cli("generate --temperature 1 --top-p 0", [*GEN, "--temperature", "1", "--top-p", "0"], "top-p|top_p"),
        _cli("generate --temperature 1 --top-k -1", [*GEN, "--temperature", "1", "--top-k", "-1"], "top-k|top_k"),
        _cli("generate --model /nonexistent", [*GEN, "--model", "/nonexistent"], "/nonexistent"),
        _cli('generate --model <dir whose config has num_hidden_layers: "4">', _bad_config_dir, "num_hidden_layers"),
        _cli("plan --mesh expert=x", ["plan", "--config", TINY, "--mesh", "expert=x"], "mesh|expert"),
        _cli("plan --mesh foo=2", ["plan", "--config", TINY, "--mesh", "foo=2"], "foo"),
        _cli("bench --ks a", ["bench", "--ks", "a", "--repeats", "1", "--prompts", "1", "--max-new-tokens", str(NEW)],
             "ks"),
        _cli_bench_plot(),
        _cli_train(),
        _cli_convert(),
        _cli("info --config /nonexistent.json", ["info", "--config", "/nonexistent.json"], "nonexistent.json"),
        _cli("forward --tokens 1,2,99999", ["forward", "--config", TINY, "--tokens", "1,2,99999"], "token|vocab"),
        _cli_forward_anywhere(),
    ]


# ----- running and reporting -----------------------------------------------------------------
def all_cases() -> list[Case]:
    return generate_cases() + forward_cases() + config_cases() + checkpoint_cases() + save_cases() + cli_cases()


def run_case(case: Case) -> dict:
    start = time.perf_counter()
    try:
        outcome, detail = case.run()
    except Exception as error:
        outcome, detail = SETUP, one_line(f"{type(error).__name__}: {error}")
    detail = re.sub(re.escape(work_dir()) + r"(/tmp\w+)?", "<tmp>", detail)
    return {"group": case.group, "case": case.name, "expected": case.expected, "outcome": outcome,
            "detail": detail, "seconds": round(time.perf_counter() - start, 1)}


def checkout() -> str:
    try:
        head = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    return head or "not a git checkout"


def counts(rows) -> dict:
    found = collections.Counter(row["outcome"] for row in rows)
    return {outcome: found[outcome] for outcome in OUTCOMES if found[outcome]}


def table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def report(result: dict) -> str:
    rows = [(f"{r['group']}: {r['case']}", r["expected"], r["outcome"], r["detail"][:120]) for r in result["cases"]]
    total = " ".join(f"{k} {v}," for k, v in result["counts"].items()).rstrip(",")
    return (f"{table(('case', 'expected', 'outcome', 'detail'), rows)}\n\n"
            f"{len(rows)} cases in {result['seconds']:.0f} s: {total}")


def compare(before_file: str, after_file: str) -> str:
    with open(before_file) as f:
        before = json.load(f)
    with open(after_file) as f:
        after = json.load(f)
    old = {(r["group"], r["case"]): r["outcome"] for r in before["cases"]}
    rows = [(f"{r['group']}: {r['case']}", old.get((r["group"], r["case"]), "-"), r["outcome"],
             "" if old.get((r["group"], r["case"])) == r["outcome"] else "*") for r in after["cases"]]
    outcomes = [o for o in OUTCOMES if o in before["counts"] or o in after["counts"]]
    totals = [(o, before["counts"].get(o, 0), after["counts"].get(o, 0)) for o in outcomes]
    return (f"before: {before['jaxmtp']} ({before['checkout']})\nafter:  {after['jaxmtp']} ({after['checkout']})\n\n"
            f"{table(('case', 'before', 'after', ''), rows)}\n\n{table(('outcome', 'before', 'after'), totals)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--only", help="run only the cases whose group or name contains this")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="side by side of two --json results")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return
    cases = [c for c in all_cases() if not args.only or args.only in f"{c.group}: {c.name}"]
    header = f"jaxmtp {jaxmtp.__file__} ({checkout()}), jax {jax.__version__} on {jax.devices()[0].platform}"
    print(header, file=sys.stderr)
    start, rows = time.perf_counter(), []
    try:
        for i, case in enumerate(cases, 1):
            rows.append(run_case(case))
            print(f"[{i}/{len(cases)}] {case.group}: {case.name}: {rows[-1]['outcome']} ({rows[-1]['seconds']} s)",
                  file=sys.stderr)
    finally:
        shutil.rmtree(work_dir(), ignore_errors=True)
    result = {"jaxmtp": jaxmtp.__file__, "checkout": checkout(), "jax": jax.__version__,
              "seconds": round(time.perf_counter() - start, 1), "counts": counts(rows), "cases": rows}
    print(json.dumps(result, indent=1) if args.json else f"{header}\n\n{report(result)}")


if __name__ == "__main__":
    main()

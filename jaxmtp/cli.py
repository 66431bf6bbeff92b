"""The `jaxmtp` command line."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmtp
from jaxmtp import DEMO_MODEL, checks
from jaxmtp.config import config_file
from jaxmtp.errors import ArgumentTypeError, CheckpointError, ConfigError, InputError
from jaxmtp.generation import MAX_SPECULATIVE_K
from jaxmtp.generation_config import DEFAULT_PREFILL_CHUNK
from jaxmtp.sharding import AXES



class UsageError(Exception):
    """A bad command line found by the checks here; the message is the whole report."""


# A path that is missing, of the wrong kind or not accessible.
_FILE_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


# jaxmtp serve --prefill: EngineConfig.concurrent_prefill
PREFILL_MODES = {"auto": None, "beside": True, "between": False}


def _user_error(error: BaseException) -> str | None:
    """The one-line report of `error` if it is the user's (bad input), None if it is a bug.

    jaxmtp raises InputError (ConfigError, CheckpointError) and ArgumentTypeError to refuse input,
    with a message written for people; an OSError about a named file is about a path the user gave.
    Anything else, ValueErrors and TypeErrors from JAX or numpy included, is a bug and keeps its
    traceback."""
    if isinstance(error, (UsageError, InputError, ArgumentTypeError)):
        return str(error)
    if isinstance(error, _FILE_ERRORS) and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    return None


@contextlib.contextmanager
def _reading(flag: str, value: str):
    """Prefixes a user error met while reading `value` with the option that named it."""
    try:
        yield
    except (ConfigError, CheckpointError, *_FILE_ERRORS) as e:
        report = _user_error(e)
        if report is None:
            raise
        raise UsageError(f"{flag} {report}" if report.startswith(value) else f"{flag} {value}: {report}") from e


_CONFIG_HELP = ("HF config.json (file or directory), or the name of a config shipped with jaxmtp: "
                + ", ".join(sorted(name.removesuffix(".json") for name in os.listdir(jaxmtp.CONFIGS))))


def _config(path: str, flag: str = "--config"):
    from jaxmtp.config import ModelConfig

    path = config_file(path)
    with _reading(flag, path):
        return ModelConfig.from_hf_config(path)


def _load(path: str, flag: str = "--model", mesh=None, quiet: bool = False, fp8_line: bool = True, **kwargs):
    """jaxmtp.load of `path`, onto the --mesh `mesh` (axis sizes, or None), first saying on stderr
    (with fp8_line) what becomes of an FP8 checkpoint's weights and why; quiet: no progress bar."""
    mesh = _device_mesh(mesh)
    with _reading(flag, path):
        from jaxmtp.checkpoint import fp8_block
        from jaxmtp.quant import fp8_choice

        block = fp8_line and os.path.isdir(path) and fp8_block(path)
        if block:
            _, reason = fp8_choice(kwargs.get("quantized"), kwargs.get("matmul"), block,
                                   keep_hint="--matmul fp8|dequant")
            print(f"FP8 weights: {reason}", file=sys.stderr, flush=True)
        return jaxmtp.load(path, mesh=mesh, quiet=quiet, **kwargs)


def _shape(sizes: dict[str, int]) -> str:
    return ",".join(f"{axis}={size}" for axis, size in sizes.items())


def _device_mesh(sizes: dict[str, int] | None):
    """The --mesh of these axis sizes over every device (of every process), or None without one;
    refused unless the sizes multiply to the device count."""
    if sizes is None:
        return None
    count, devices = math.prod(sizes.values()), jax.device_count()
    if count != devices:
        sizes_text = " x ".join(str(size) for size in sizes.values())
        emulate = (f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={count} emulates {count} devices"
                   if jax.devices()[0].platform == "cpu" else "")
        raise UsageError(f"--mesh {_shape(sizes)}: data x expert x tensor = {sizes_text} = {count} devices, but "
                         f"jax.device_count() is {devices} (every process's devices); the sizes must multiply to "
                         f"the device count{emulate}")
    return jaxmtp.make_mesh(**sizes)


# argparse `type=` functions: a bad value is reported as "argument --flag: <message>", exit 2.

def _checked(check, parse, text: str, *bounds, **options):
    """`text` parsed by `parse` (int or float) and bounded by the `jaxmtp.checks` function `check`,
    which words the refusal; text that is no number reaches the check as it is, to be named so."""
    try:
        value = parse(text)
    except ValueError:
        value = text
    try:
        return check("value", value, *bounds, **options)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None


def _whole(text: str, minimum: int, maximum: int | None = None) -> int:
    return _checked(checks.whole, int, text, minimum, maximum)


def _positive(text: str) -> int:
    return _whole(text, minimum=1)


def _non_negative(text: str) -> int:
    return _whole(text, minimum=0)


def _draft_count(text: str) -> int:
    return _whole(text, minimum=0, maximum=MAX_SPECULATIVE_K)


def _chunk(text: str) -> int:
    """--prefill-chunk: a positive multiple of 16."""
    value = _whole(text, minimum=16)
    if value % 16:
        raise argparse.ArgumentTypeError(f"expected a multiple of 16, found {value}")
    return value


def _real(text: str, minimum: float, maximum: float = math.inf, above_minimum: bool = False) -> float:
    return _checked(checks.real, float, text, minimum, maximum, above_minimum=above_minimum)


def _temperature(text: str) -> float:
    return _real(text, 0.0)


def _top_p(text: str) -> float:
    return _real(text, 0.0, 1.0, above_minimum=True)


def _learning_rate(text: str) -> float:
    return _real(text, 0.0, above_minimum=True)


def _k_value(text: str):
    """--k: "auto" or a whole number of drafts."""
    if text == "auto":
        return text
    try:
        return _draft_count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f'expected "auto" or an integer 0..{MAX_SPECULATIVE_K}, found {text!r}') from None


def _token_ids(text: str) -> list[int]:
    """One prompt: "1,2,3"."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, found {text!r}")
    return ids


def _prompt_ids(text: str) -> list[list[int]]:
    """Prompts: "1,2,3;4,5"."""
    try:
        return [_token_ids(row) for row in text.split(";")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f'expected comma-separated non-negative integers, prompts separated '
                                         f'by ";", found {text!r}') from None


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _stop_string(text: str) -> str:
    """--stop: the text with \\n, \\t, \\r and \\\\ read as the characters they name."""
    out = re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)
    if not out:
        raise argparse.ArgumentTypeError("expected a non-empty text")
    return out


def _ks(text: str) -> list[int]:
    """--ks: "1,2,3,4"."""
    try:
        return [_whole(k, 1, MAX_SPECULATIVE_K) for k in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers 1..{MAX_SPECULATIVE_K}, found {text!r}") from None


def _sizes(text: str) -> tuple[int, ...]:
    """--buckets: "1,4,16" -> batch sizes."""
    try:
        return tuple(_whole(b, 1) for b in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, found {text!r}") from None


def _mesh(text: str) -> dict[str, int]:
    """--mesh: "expert=8,tensor=8" -> the size of each axis (1 where not named)."""
    sizes = dict.fromkeys(AXES, 1)
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated axis=size pairs (axes {', '.join(AXES)}; "
                                             f"sizes positive integers), found {text!r}")
        sizes[name] = int(value)
    return sizes


def _is_v4(path: str, flag: str) -> bool:
    """Whether a config (a file, a checkpoint directory or a shipped config's name) is DeepSeek-V4's."""
    from jaxmtp.config import V4_MODEL_TYPES, _read_json

    path = config_file(path)
    with _reading(flag, path):
        return _read_json(path).get("model_type") in V4_MODEL_TYPES


def _count(n: int) -> str:
    """A parameter count in billions, or trillions from 1,000 B."""
    return f"{n / 1e12:8.2f} T" if n >= 1e12 else f"{n / 1e9:8.2f} B"


def _info_v4(args):
    from jaxmtp.models.deepseek_v4.config import V4Config
    from jaxmtp.models.deepseek_v4.model import cache_bytes, parameter_counts

    if args.lower:
        raise UsageError("--lower: not available for DeepSeek-V4 configs yet")
    path = config_file(args.config)
    with _reading("--config", path):
        config = V4Config.from_hf_config(path)
    counts = parameter_counts(config)
    print(f"parameters, main model:              {_count(counts['main'])} ({counts['main']:,})")
    print(f"parameters, active per token:        {_count(counts['active'])}")
    print(f"parameters, MTP block:               {_count(counts['mtp'])} ({counts['mtp']:,})")
    kinds = ", ".join(f"{config.layer_types.count(kind)} {name}" for kind, name in
                      (("compressed_sparse_attention", "CSA"), ("heavily_compressed_attention", "HCA"),
                       ("sliding_attention", "sliding-window only")))
    growing, bounded = cache_bytes(config, jnp.bfloat16)
    print(f"layers: {kinds}; MTP block: sliding-window only")
    print(f"cache, bf16: {growing:,} B per token (compressed entries and index keys, all layers), plus "
          f"{bounded:,} B per sequence (windows and pooling rows, incl. MTP)")


def _info(args):
    from jaxmtp.cache import bytes_per_token
    from jaxmtp.layout import CHECKPOINT
    from jaxmtp.model import apply_forward, apply_mtp_forward
    from jaxmtp.params import abstract_params, parameter_counts

    if _is_v4(args.config, "--config"):
        return _info_v4(args)
    config = _config(args.config)
    counts = parameter_counts(config)
    print(f"parameters, main model:              {counts['main'] / 1e9:8.2f} B ({counts['main']:,})")
    print(f"parameters, unique to MTP:           {counts['mtp_unique'] / 1e9:8.2f} B ({counts['mtp_unique']:,})")
    print(f"parameters, MTP with embed/head copy:{counts['mtp_with_copies'] / 1e9:8.2f} B")
    per_token = bytes_per_token(config, jnp.bfloat16)
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    what = "MLA + indexer key" if config.has_indexer else "MLA"
    print(f"cache ({what}), bf16: {per_token} B per token per layer, {per_token * layers:,} B per token "
          f"({layers} layers incl. MTP)")
    if args.lower:
        params = abstract_params(config, jnp.bfloat16)
        tokens = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32)
        start = time.perf_counter()
        apply_forward.lower(config, jnp.dtype(jnp.bfloat16), CHECKPOINT, params, tokens)
        mid = time.perf_counter()
        hidden = jax.ShapeDtypeStruct((args.batch, args.length, config.hidden_size), jnp.bfloat16)
        if config.has_mtp:
            apply_mtp_forward.lower(config, jnp.dtype(jnp.bfloat16), CHECKPOINT, params, hidden, tokens)
        end = time.perf_counter()
        print(f"jit(forward).lower on abstract bf16 parameters, batch {args.batch} x {args.length}: {mid - start:.1f} s")
        print(f"jit(mtp_forward).lower: {end - mid:.1f} s")


def _forward_demo(args):
    if args.model:
        model = _load(args.model, mesh=args.mesh, matmul=args.matmul)
    else:
        if args.matmul:
            raise UsageError("--matmul applies to an FP8 checkpoint (--model), not to a random init of --config")
        model = jaxmtp.init(_config(args.config), seed=args.seed, mesh=_device_mesh(args.mesh))
    tokens = np.array([args.tokens])
    logits, hidden = model.forward(tokens)
    print(f"tokens: {tokens[0].tolist()}")
    print(f"main model, next-token argmax per position: {np.asarray(logits.argmax(-1))[0].tolist()}")
    if model.config.has_mtp:
        predicted = logits.argmax(-1)
        mtp_logits = model.mtp_forward(hidden, predicted)
        print(f"MTP module, token after next per position:  {np.asarray(mtp_logits.argmax(-1))[0].tolist()}")


def _prompts(args, tokenizer):
    """Prompts as token-id lists: --tokens, else the text prompts through the model's tokenizer."""
    if args.tokens:
        if getattr(args, "chat", False):
            raise UsageError("--chat: applies the chat template to text prompts, not to --tokens")
        return args.tokens
    if tokenizer is None:
        found = ("has a tiktoken tokenizer (tiktoken.model, as Kimi K2 ships), which jaxmtp does not read"
                 if os.path.exists(os.path.join(args.model, "tiktoken.model")) else "has no tokenizer.json")
        raise UsageError(f"--model {args.model}: {found} to encode text prompts; pass token ids with --tokens 1,2,3")
    if args.chat:
        from jaxmtp.chat import chat_prompt

        # The template writes the special tokens (BOS, role markers) itself.
        return [tokenizer.encode(chat_prompt(args.model, text), add_special_tokens=False).ids for text in args.prompt]
    return [tokenizer.encode(text).ids for text in args.prompt]


def _tokenizer(model_dir):
    """The model directory's tokenizer.json as a `tokenizers.Tokenizer`, or None."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _check_plot_target(path: str):
    """Refuses a --plot that could not be written, before a benchmark of minutes runs: matplotlib
    missing, a missing or read-only directory, a file type matplotlib cannot write."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"--plot {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"--plot {path}: directory {directory} is not writable")
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix and suffix not in kinds:
        raise UsageError(f"--plot {path}: expected a file type matplotlib writes ({', '.join(sorted(kinds))}), "
                         f"found .{suffix}")


def _bench(args):
    import hashlib
    import json

    from jaxmtp import bench, data

    if args.plot:
        _check_plot_target(args.plot)
    model = _load(args.model, mesh=args.mesh, quiet=True, matmul=args.matmul)
    if args.tokens:
        prompts = args.tokens
        source, prompts_sha256 = "--tokens", hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    else:
        tokenizer = _tokenizer(args.model)
        if tokenizer is None:
            raise UsageError(f"--model {args.model}: no tokenizer.json to encode the held-out prompts; pass "
                             "prompts with --tokens")
        prompts = data.held_out_prompts(tokenizer, args.prompts, args.prompt_len)
        source = (f"{args.prompts} prompts of {args.prompt_len} tokens from the shipped held-out standard-library "
                  "excerpts")
        prompts_sha256 = data.prompts_sha256()
    rows = bench.run(model, prompts, args.ks, args.max_new_tokens, args.repeats, auto=not args.no_auto)
    figures = {"model": os.path.basename(os.path.normpath(args.model)), "prompts": source,
               "prompts_sha256": prompts_sha256, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
               "platform": jax.devices()[0].platform, "rows": rows}
    if args.save:
        from jaxmtp.provenance import write

        write(args.save, "bench", figures, {"seconds": {str(r["k"]): r["seconds"] for r in rows}}, args.repeats,
              prompts_sha256=prompts_sha256)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"{args.model}: {source}, batch 1, greedy, {args.max_new_tokens} new tokens each, "
              f"{jax.devices()[0].platform}; median of {args.repeats} runs, compile excluded; decode = without the "
              f"prefill; cost = a round in plain steps; ideal = mean len / cost")
        print(bench.table(rows))
    if args.plot:
        bench.plot(rows, args.plot)


def _generation_config(args, model):
    """The generation settings: flags over the model directory's generation_config.json over the
    defaults; --ignore-eos drops every EOS id (else the file's, or the model config's)."""
    from jaxmtp.generation_config import GenerationConfig

    flags = {name: getattr(args, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                                    "prefill_chunk")
             if getattr(args, name) is not None}
    config = GenerationConfig.from_pretrained(args.model, speculative_k=args.k, stop=tuple(args.stop),
                                              stop_token_ids=tuple(map(tuple, args.stop_tokens or ())), **flags)
    if args.ignore_eos:
        return config.replace(eos_token_id=None)
    return config if config.eos_token_id is not None else config.replace(eos_token_id=model.config.eos_token_id)


def _generate(args):
    from jaxmtp.generation import generate_stream, warm_up
    from jaxmtp.streaming import echo

    # The prompts are encoded (or refused) before the weights are read, which for a published
    # checkpoint takes many minutes; a --model that is no directory is the loader's to name.
    tokenizer, prompts = _text_inputs(args) if os.path.isdir(args.model) else (None, None)
    v4 = os.path.isdir(args.model) and _is_v4(args.model, "--model")
    if v4:
        model = _load_v4(args.model, mesh=args.mesh, matmul=args.matmul)
    else:
        model = _load(args.model, mesh=args.mesh, quiet=args.quiet, fp8_line=not args.quiet, matmul=args.matmul)
    config = _generation_config(args, model)
    if not model.config.has_mtp:
        why = (getattr(model, "mtp_note", None) or "num_nextn_predict_layers = 0")
        print(f"no MTP layer in this model ({why}): speculation needs one, so this is plain decoding", file=sys.stderr)
        config = config.replace(speculative_k=0) if v4 else config
    compile_s = None  # a DeepSeek-V4 model compiles each round's program on first use, within the run
    if not v4:
        with _Progress(quiet=args.quiet) as progress:
            compile_s = warm_up(model, prompts, config, progress=progress)
    for prompt in prompts:
        stream = generate_stream(model, prompt, config, tokenizer=tokenizer)
        run_s, first_s = echo(stream, prompt, tokenizer)
        _report(stream.output, config, run_s, first_s, compile_s)


def _load_v4(path: str, *, mesh, matmul, flag: str = "--model"):
    """A DeepSeek-V4 checkpoint for `generate` and `serve` (jaxmtp.models.deepseek_v4.load_v4): FP8
    and FP4 weights kept, on one device or --mesh (over every process's devices with --distributed)."""
    from jaxmtp.models.deepseek_v4 import load_v4

    with _reading(flag, path):
        return load_v4(path, matmul=matmul or "dequant", mesh=_device_mesh(mesh))


def _text_inputs(args):
    """(the model directory's tokenizer or None, the prompts as token-id lists) for `generate`."""
    tokenizer = _tokenizer(args.model)
    if args.stop and tokenizer is None:
        raise UsageError(f"--stop: --model {args.model} has no tokenizer.json to decode the text with")
    return tokenizer, _prompts(args, tokenizer)


class _Progress:
    """Prints each stage of the preparation on stderr as it starts, and every TICK seconds while one
    lasts, so that a first run's compiling reads as work, not as a hang."""

    TICK = 5.0

    def __init__(self, quiet: bool = False):
        import threading

        self.quiet, self.began, self.stage = quiet, time.perf_counter(), None
        self.changed, self.stopped = threading.Condition(), False
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self):
        if not self.quiet:
            self.thread.start()
        return self

    def __call__(self, stage: str):
        with self.changed:
            if stage == self.stage:
                return
            self.stage, self.since = stage, time.perf_counter()
            self._print(f"{stage} ...")
            self.changed.notify()

    def __exit__(self, *exc):
        with self.changed:
            if self.stage is not None:
                self._print(f"ready after {time.perf_counter() - self.began:.0f} s")
            self.stopped = True
            self.changed.notify()

    def _print(self, line: str):
        if not self.quiet:
            print(f"[{time.perf_counter() - self.began:5.1f} s] {line}", file=sys.stderr, flush=True)

    def _tick(self):
        with self.changed:
            while not self.stopped:
                if not self.changed.wait(self.TICK) and self.stage is not None and not self.stopped:
                    self._print(f"  still {self.stage.split(' (')[0]} ({time.perf_counter() - self.since:.0f} s)")


def _report(out, config, run_s, first_s, compile_s):
    from jaxmtp.adaptive import plain_reason

    new = sum(len(t) for t in out.tokens)
    s = out.stats
    compiling = "compiling and measuring included" if compile_s is None else f"compile {compile_s:.1f} s, not included"
    print(f"{new} new tokens in {run_s:.3f} s: {new / run_s:.1f} tokens/s, the first after {1000 * first_s:.0f} ms "
          f"({compiling})")
    if s.chose_plain:
        print(f"speculative_k=auto decoded plainly: {plain_reason(s.round_costs)}. `jaxmtp bench` measures each k "
              "against plain decoding here.")
    elif config.speculative_k and not s.draft_tokens:
        print("speculative_k=auto drafted nothing in this run: its rounds at k = 0 are plain decoding steps. "
              "`jaxmtp bench` measures each k against plain decoding here.")
    elif config.speculative_k:
        per_position = ", ".join(f"{a:.2f}" for a in s.per_position_acceptance)
        by_k = ", ".join(f"k={k}: {n}" for k, n in s.rounds_by_k.items())
        print(f"k={config.speculative_k}: acceptance rate {s.acceptance_rate:.3f}, mean accepted length "
              f"{s.mean_accepted_length:.2f}, per position [{per_position}]; rounds {by_k}")
        if s.round_costs is not None:
            print("round cost in plain steps at k = 0..: " + " ".join(f"{c:.2f}" for c in s.round_costs))
    print(f"main forward passes {s.main_forward_passes} (incl. prefill), drafts {s.draft_tokens}, "
          f"accepted {s.accepted_tokens}")


def _serve(args):
    """Loads the model, starts the engine (compiling and measuring, with progress on stderr), then
    serves the OpenAI-compatible API until SIGTERM or SIGINT has drained it (jaxmtp.serve)."""
    from jaxmtp import compile_cache
    from jaxmtp.engine import Engine, Replicas
    from jaxmtp.generation_config import GenerationConfig
    from jaxmtp.serve import Defaults, bind, create_app, serve

    model_dir = DEMO_MODEL if args.model == "demo" else args.model
    name = args.served_model_name or ("demo" if args.model == "demo" else os.path.basename(os.path.normpath(model_dir)))
    if args.replicas > 1 and (args.mesh or args.distributed):
        raise UsageError(f"--replicas {args.replicas}: replicas run in one process on one device, not with "
                         f"{'--mesh' if args.mesh else '--distributed'}")
    if args.max_batch % args.replicas:
        raise UsageError(f"--replicas {args.replicas}: --max-batch {args.max_batch} does not divide into "
                         f"{args.replicas} replicas' slots")
    template = _serve_template(args, model_dir)  # a bad template or port is refused before the weights are read
    leader = jax.process_index() == 0  # with --distributed, process 0 serves and the others follow it
    try:
        sock = bind(args.host, args.port) if leader else None
    except OSError as e:
        raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror})") from None
    if os.path.isdir(model_dir) and _is_v4(model_dir, "MODEL"):
        model = _load_v4(model_dir, mesh=args.mesh, matmul=args.matmul, flag="MODEL")
    else:
        model = _load(model_dir, flag="MODEL", mesh=args.mesh, quiet=args.quiet, fp8_line=not args.quiet,
                      matmul=args.matmul)
    longest = model.config.max_position_embeddings
    if args.max_len is not None and args.max_len > longest:
        raise UsageError(f"--max-len {args.max_len}: longer than the model's max_position_embeddings ({longest})")
    with _reading("MODEL", model_dir):
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    compile_cache.enable()  # a restarted server loads the programs it compiled before
    with _Progress(quiet=args.quiet) as progress:
        options = dict(tokenizer=_tokenizer(model_dir), eos_token_id=model.config.eos_token_id if eos is None else eos,
                       progress=progress, slots=args.max_batch, max_len=args.max_len or min(longest, 4096),
                       speculative_k=args.speculative_k, max_queue=args.max_queue, buckets=args.buckets,
                       prefill_chunk=args.prefill_chunk, prefix_blocks=args.prefix_blocks,
                       sampling=not args.greedy_only, concurrent_prefill=PREFILL_MODES[args.prefill])
        engine = Replicas(model, replicas=args.replicas, **options) if args.replicas > 1 else Engine(model, **options)
        engine.start()  # on a process other than 0: runs process 0's operations until it shuts down
    if not leader:
        return
    temperature = args.temperature if args.temperature is not None else 0.0 if args.greedy_only else 1.0
    defaults = Defaults(temperature=temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens)
    app = create_app(engine, model_name=name, chat_template=template, defaults=defaults,
                     shutdown_timeout=args.shutdown_timeout)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    serve(app, sock, quiet=args.quiet,
          on_ready=lambda: print(f"serving {args.model} at {url}", file=sys.stderr, flush=True))


def _serve_template(args, model_dir: str):
    """The chat template of `serve`: --chat-template's file, else the model's own, else None; its
    Jinja syntax checked. The special tokens it may write come from the model's tokenizer_config.json."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    from jaxmtp.chat import FILE, read_template
    from jaxmtp.serve import ChatTemplate

    with _reading("MODEL", model_dir):
        found = read_template(model_dir) if os.path.isdir(model_dir) else None
    tokens = found[1] if found else {}
    if args.chat_template:
        flag, source = "--chat-template", args.chat_template
        with _reading(flag, source), open(source, encoding="utf-8") as f:
            text = f.read()
    elif found:
        flag, source, text = "MODEL", os.path.join(model_dir, FILE), found[0]
    else:
        return None
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"{flag} {source}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return ChatTemplate(text, **tokens)


def _plan(args):
    sizes = args.mesh
    count = sizes["data"] * sizes["expert"] * sizes["tensor"]
    # Emulate the mesh with host devices; XLA reads this when the backend starts, which is below.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    if jax.device_count() < count:
        shape = ",".join(f"{axis}={size}" for axis, size in sizes.items())
        raise UsageError(f"--mesh {shape}: needs {count} devices; this process has {jax.device_count()}")
    from jaxmtp.plan import (DEVICES, allocator_settings, default_loops, fit, fit_report, memory_limit, plans, report,
                             total_bytes)

    if _is_v4(args.config, "--config"):  # DeepSeek-V4 compiles its own programs (a prefill chunk and a round)
        from jaxmtp.models.deepseek_v4.config import V4Config
        from jaxmtp.models.deepseek_v4.plan import plans as planner

        with _reading("--config", config_file(args.config)):
            config = V4Config.from_hf_config(config_file(args.config))
    else:
        planner, config = plans, _config(args.config)
    if args.k and not config.has_mtp and args.loop != "auto":
        raise UsageError(f"--k {args.k}: --config {args.config} has no MTP layer (num_nextn_predict_layers = 0); "
                         "plan its plain decoding with --k 0")
    settings = allocator_settings()  # JAX's GPU memory settings, from this process's environment
    loops = default_loops(config, args.k, args.loop, args.greedy)
    if args.fit:
        if args.prompt_len:
            raise UsageError("--fit searches caches with prompts as long as they are; --prompt-len does not apply")
        limit = memory_limit(DEVICES[args.fit], settings)

        def shown(f):
            if not args.quiet:
                print(f"  compiled batch {f['batch']}, cache {f['cache_len']}, {f['loop']}: "
                      f"{total_bytes(f) / 1e9:.2f} GB per device ({f['compile_seconds']:.0f} s)", flush=True)

        if not args.quiet:
            print(f"searching within {limit.describe()}", flush=True)
        results = fit(config, **sizes, capacity=limit.bytes, k=args.k, matmul=args.matmul,
                      prefill_chunk=args.prefill_chunk, progress=shown, loops=loops, planner=planner)
        print(fit_report(results, limit))
        return
    if args.prompt_len and args.prompt_len > args.max_len:
        raise UsageError(f"--prompt-len {args.prompt_len}: longer than the cache (--max-len {args.max_len})")
    results = planner(config, **sizes, batch=args.batch, max_len=args.max_len,
                      prompt_len=args.prompt_len or args.max_len // 2, loops=loops, matmul=args.matmul,
                      prefill_chunk=args.prefill_chunk)
    print(report(results, [memory_limit(device, settings) for device in DEVICES.values()]))


def _train_inputs(args):
    """(model, tokenizer) of --init for --mtp-only, else the --config to build them from (after the
    checks, as building the tokenizer takes a while); read before anything is written, so that a bad
    argument leaves nothing behind."""
    if not args.mtp_only:
        if args.init:
            raise UsageError("--init applies with --mtp-only only; full training starts from a random init of "
                             "--config")
        return None, None, _config(args.config)
    if not args.init:
        raise UsageError("--mtp-only needs --init PATH (the checkpoint whose MTP layer to fine-tune)")
    tokenizer = _tokenizer(args.init)
    if tokenizer is None:
        raise UsageError(f"--init {args.init}: no tokenizer.json; the training data is encoded with the "
                         "checkpoint's own tokenizer")
    model = _load(args.init, flag="--init", dtype="float32", quantized="dequantize", quiet=args.quiet, fp8_line=False)
    return model, tokenizer, None


def _train(args):
    import json
    import tempfile

    from jaxmtp import data, train
    from jaxmtp.checkpoint.save import check_destination

    cfg = train.TrainConfig(steps=args.steps, batch=args.batch, seq_len=args.seq_len, learning_rate=args.lr,
                            seed=args.seed, mtp_only=args.mtp_only, mtp_depth=args.mtp_depth)
    model, tokenizer, config = _train_inputs(args)
    with _reading("--out", args.out):
        check_destination(args.out, args.overwrite)  # now, not after the training
    corpus = data.Corpus.read(tokenizer, config and config.vocab_size)
    if config is not None:
        model = jaxmtp.init(config, seed=args.seed)
    print(f"data: {corpus}")
    # Everything beside the weights is staged here and goes into --out with them in one step
    # (jaxmtp.save), so --out never holds a half-written result.
    with tempfile.TemporaryDirectory(prefix="jaxmtp-train-") as staging:
        before = train.evaluate(model, corpus.held_out, args.seq_len) if args.mtp_only else None
        model, log = train.train(model, corpus.train, cfg, os.path.join(staging, "train_log.jsonl"), quiet=args.quiet)
        after = train.evaluate(model, corpus.held_out, args.seq_len)
        corpus.tokenizer.save(os.path.join(staging, "tokenizer.json"))
        command = "jaxmtp " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("jaxmtp") else None
        figures = train.record(cfg, corpus.summary(), log, after, before, init=args.init, command=command)
        with open(os.path.join(staging, "training.json"), "w") as f:
            json.dump(figures, f, indent=2, default=float)
        if not args.mtp_only:
            shutil.copy(config_file(args.config), os.path.join(staging, "source_config.json"))
        jaxmtp.save(model, args.out, format="hf", overwrite=args.overwrite,
                    extra_files=[os.path.join(staging, name) for name in sorted(os.listdir(staging))])
    for name, figures in (("before", before), ("after", after)):
        if figures:
            print(f"held out ({name}): {train.describe(figures)}")


def _convert(args):
    from jaxmtp.checkpoint import convert

    if os.path.isdir(args.src) and _is_v4(args.src, "src"):
        return _convert_v4(args)
    if args.format == "deepseek":
        raise UsageError("--format deepseek: DeepSeek-V4's released layout, for DeepSeek-V4 checkpoints only")
    figures = convert(args.src, args.dst, args.format, dtype=args.dtype, quantized=args.quantized,
                      overwrite=args.overwrite, mesh=_device_mesh(args.mesh))
    print(f"{args.src} -> {args.dst} ({args.format}, {figures['dtype']}): "
          f"load {figures['load_s']:.1f} s, save {figures['save_s']:.1f} s")


def _convert_v4(args):
    """`convert` of a DeepSeek-V4 checkpoint: to DeepSeek's released layout (FP8 and FP4 kept, or
    dense) or to transformers' (dense)."""
    from jaxmtp.models.deepseek_v4 import load_v4, save_v4

    if args.format == "orbax" or args.mesh:
        raise UsageError(f"{'--format orbax' if args.format == 'orbax' else '--mesh'}: not available for "
                         "DeepSeek-V4 checkpoints yet; --format deepseek or hf, on one device")
    began = time.perf_counter()
    with _reading("src", args.src):
        model = load_v4(args.src, dtype=args.dtype or "bfloat16", keep_quantized=args.quantized == "keep")
    loaded = time.perf_counter()
    save_v4(model, args.dst, layout=args.format, overwrite=args.overwrite)
    print(f"{args.src} -> {args.dst} ({args.format}, {args.dtype or 'bfloat16'}): load {loaded - began:.1f} s, "
          f"save {time.perf_counter() - loaded:.1f} s")


_MESH_HELP = ("load the model onto a mesh of these axis sizes, each device reading only its block of each "
              "parameter: e.g. data=2,expert=2,tensor=2 (axes data, expert, tensor; 1 where not named); the sizes "
              "must multiply to the number of devices (of every process with --distributed; on a CPU, emulate N "
              "with XLA_FLAGS=--xla_force_host_platform_device_count=N); without it, one device")
_DISTRIBUTED_HELP = ("multi-host: call jax.distributed.initialize() first (it reads the cluster from the "
                     "environment), run the same command on every host; only process 0 prints")
_MATMUL_HELP = ("FP8 checkpoints: keep the weights in FP8 and multiply them with the W8A8 kernels (fp8) or "
                "dequantize them on the fly (dequant); without it, they stay FP8 with the kernels where the "
                "platform multiplies FP8 (GPUs and TPUs with FP8 matmul) and are dequantized at load elsewhere "
                "(CPUs); a line on stderr says which")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None and []: those options' help says what leaving them
    out does."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, []) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every `jaxmtp` command (docs/cli.md is rendered from it by tools/render_cli.py)."""
    parser = argparse.ArgumentParser(prog="jaxmtp", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error in the input too, not only of a bug")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, run, help):
        p = sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)
        p.set_defaults(run=run)
        return p

    def on_devices(p, matmul=True):
        """--mesh and --distributed (and --matmul) for a command that loads a model."""
        p.add_argument("--mesh", type=_mesh, help=_MESH_HELP)
        p.add_argument("--distributed", action="store_true", help=_DISTRIBUTED_HELP)
        if matmul:
            p.add_argument("--matmul", choices=("fp8", "dequant"), help=_MATMUL_HELP)

    info = command("info", _info, "parameter counts and cache size of a config; optionally lower it")
    info.add_argument("--config", required=True, help=_CONFIG_HELP)
    info.add_argument("--lower", action="store_true", help="time jax.jit(forward).lower on abstract parameters")
    info.add_argument("--batch", type=_positive, default=1, help="batch size for --lower")
    info.add_argument("--length", type=_positive, default=128, help="sequence length for --lower")

    fwd = command("forward", _forward_demo, "one forward pass (main + MTP) and the predicted tokens")
    fwd.add_argument("--model", help="checkpoint directory; without it, a random init of --config")
    fwd.add_argument("--config", default="tiny", help="the random model's config (without --model): " + _CONFIG_HELP)
    fwd.add_argument("--tokens", type=_token_ids, default="1,2,3,4,5,6,7,8", help="token ids, comma-separated")
    fwd.add_argument("--seed", type=int, default=0, help="seed of the random init")
    on_devices(fwd)

    gen = command("generate", _generate, "generate text with plain or MTP speculative decoding")
    gen.add_argument("prompt", nargs="*", default=["def fibonacci(n):"],
                     help="prompt texts, one generation each (needs the model's tokenizer.json)")
    gen.add_argument("--model", default=DEMO_MODEL, help="checkpoint directory; the default is the bundled demo model")
    gen.add_argument("--tokens", type=_prompt_ids,
                     help='token ids instead of text: "1,2,3", several prompts separated by ";"')
    gen.add_argument("--k", type=_k_value, default="auto",
                     help=f'MTP drafts per round, 0..{MAX_SPECULATIVE_K}; 0 = plain decoding; "auto": chosen as it '
                          "goes, from the measured cost of a round at each k on this machine and the acceptance so far")
    defaults = "; default: the model's generation_config.json, else "
    gen.add_argument("--max-new-tokens", type=_positive, help="new tokens per prompt, at most" + defaults + "64")
    gen.add_argument("--prefill-chunk", type=_chunk,
                     help=f"prompt positions prefilled at once (a multiple of 16); default {DEFAULT_PREFILL_CHUNK}")
    gen.add_argument("--temperature", type=_temperature, help="sampling temperature; 0 = greedy" + defaults + "0")
    gen.add_argument("--top-k", type=_non_negative, help="sample from the k likeliest tokens; 0 = all" + defaults + "0")
    gen.add_argument("--top-p", type=_top_p,
                     help="sample from the smallest set of tokens with this much probability; 1 = all" + defaults + "1")
    gen.add_argument("--seed", type=int, help="sampling seed (default 0)")
    gen.add_argument("--stop", action="append", type=_stop_string, default=[],
                     help='end a completion at this text (not printed); repeatable; "\\n" and "\\t" are newline '
                          "and tab")
    gen.add_argument("--stop-tokens", type=_prompt_ids,
                     help='end a completion after these token sequences: "1,2;3" (the sequence 1 2, or 3)')
    gen.add_argument("--chat", action="store_true",
                     help="each prompt is a user message, written with the model's chat template "
                          "(tokenizer_config.json)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at the EOS ids (generation_config.json's, else the config's)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar nor progress lines")
    on_devices(gen)

    b = command("bench", _bench, "plain vs speculative decoding side by side: tokens/s, speedup, acceptance")
    b.add_argument("--model", default=DEMO_MODEL, help="checkpoint directory; the default is the bundled demo model")
    b.add_argument("--tokens", type=_prompt_ids,
                   help='prompts as token ids instead of held-out text: "1,2,3;4,5"')
    b.add_argument("--prompts", type=_positive, default=8, help="number of held-out prompts")
    b.add_argument("--prompt-len", type=_positive, default=32, help="tokens per held-out prompt")
    b.add_argument("--max-new-tokens", type=_positive, default=64, help="new tokens per prompt")
    b.add_argument("--ks", type=_ks, default="1,2,3,4", help="fixed draft counts to run beside plain decoding")
    b.add_argument("--no-auto", action="store_true", help='leave out speculative_k="auto"')
    b.add_argument("--repeats", type=_positive, default=3, help="timed runs of each configuration (median taken)")
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    b.add_argument("--save", help="also write the results with their provenance (commit, versions, device, command) "
                                  "to this JSON file, as benchmarks/results/ keeps them")
    b.add_argument("--plot", help="write acceptance-by-position and speedup-by-k plots to this image file")
    on_devices(b)

    pl = command("plan", _plan, "per-device memory of speculative generation on a mesh (AOT compile, abstract shapes)")
    pl.add_argument("--config", required=True, help=_CONFIG_HELP)
    pl.add_argument("--mesh", type=_mesh, default="tensor=8",
                    help="axis sizes, e.g. expert=8,tensor=8 (axes data, expert, tensor; 1 where not named)")
    pl.add_argument("--batch", type=_positive, default=8, help="rows generated at once")
    pl.add_argument("--max-len", type=_positive, default=4096, help="cache length in tokens")
    pl.add_argument("--prompt-len", type=_positive, help="prompt bucket in tokens; without it, half of --max-len")
    pl.add_argument("--k", type=_draft_count, default=2, help="MTP drafts per round of the fixed-k loop")
    pl.add_argument("--loop", choices=("auto", "fixed", "both"), default="both",
                    help='decode loops to compile, the largest counting: "auto" (what generate runs by default: '
                         f'k = 0..{jaxmtp.generation.AUTO_MAX_K} per round on a GPU or TPU), "fixed" (--k), or both')
    pl.add_argument("--greedy", action="store_true",
                    help="plan greedy decoding; without it, sampling with top-k and top-p")
    pl.add_argument("--prefill-chunk", type=_chunk, default=DEFAULT_PREFILL_CHUNK,
                    help="prompt positions prefilled at once (a multiple of 16)")
    pl.add_argument("--fit", choices=("h200", "h100", "v5p", "v6e"),
                    help="instead of one plan: the largest cache (with a prompt as long) that fits the memory JAX "
                         "may hold on this device (on a GPU: XLA_CLIENT_MEM_FRACTION, default 0.75, of its memory), "
                         "for batches of 1, 2, 4 and 8 rows per data shard (several compiles)")
    pl.add_argument("--quiet", action="store_true", help="with --fit: no line per compile")
    pl.add_argument("--matmul", choices=("dequant", "fp8"), default="dequant",
                    help="how kept FP8 weights are multiplied (fp8: the W8A8 kernels, here lowered in interpret mode)")

    tr = command("train", _train, "train a small DeepSeek-V3 + MTP on the standard library's source")
    tr.add_argument("--out", required=True, help="output checkpoint directory (HF layout + tokenizer.json)")
    tr.add_argument("--config", default="demo", help=_CONFIG_HELP)
    tr.add_argument("--steps", type=_positive, default=1200, help="optimizer steps")
    tr.add_argument("--batch", type=_positive, default=16, help="sequences per step")
    tr.add_argument("--seq-len", type=_positive, default=256, help="tokens per sequence")
    tr.add_argument("--lr", type=_learning_rate, default=3e-3, help="peak learning rate")
    tr.add_argument("--seed", type=int, default=0, help="seed of the init and of the batch order")
    tr.add_argument("--mtp-only", action="store_true", help="fine-tune only the MTP layer of --init")
    tr.add_argument("--init", help="checkpoint to start from (with --mtp-only)")
    tr.add_argument("--mtp-depth", type=_positive, default=1,
                    help="with --mtp-only: train this many chained drafting steps (draft j reads draft j-1's hidden state)")
    tr.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")

    conv = command("convert", _convert, "rewrite a checkpoint (HF, DeepSeek mp-sharded or orbax) as HF or orbax; "
                   "a DeepSeek-V4 one as HF or DeepSeek's released layout")
    conv.add_argument("src", help="checkpoint directory")
    conv.add_argument("dst", help="output directory")
    conv.add_argument("--format", choices=("hf", "orbax", "deepseek"), required=True,
                      help="output format (deepseek: DeepSeek-V4's released layout, for V4 checkpoints)")
    conv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="dense parameter dtype; without it, the source's")
    conv.add_argument("--quantized", choices=("keep", "dequantize"), default="keep",
                      help="FP8 weights: keep them FP8 with their scales, or write dense --dtype weights")
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    on_devices(conv, matmul=False)

    sv = command("serve", _serve, "an OpenAI-compatible HTTP server (completions, chat completions, streaming, "
                                  "metrics) over the serving engine: continuous batching with MTP speculation")
    sv.add_argument("model", metavar="MODEL", help='checkpoint directory, or "demo" for the bundled demo model')
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=lambda text: _whole(text, 0, 65535), default=8000,
                    help="port to listen on; 0 = a free one, which the ready line names")
    sv.add_argument("--max-batch", type=_positive, default=16, help="requests decoded at once (the engine's slots)")
    sv.add_argument("--replicas", type=_positive, default=1,
                    help="engines sharing the model, each with --max-batch / N slots and threads of its own; a "
                         "request goes to the one holding its prompt's prefix, else the least busy. XLA runs one "
                         "program on one CPU core, so on a CPU two replicas decode on two cores; one process on one "
                         "device only")
    sv.add_argument("--max-len", type=_positive,
                    help="prompt plus new tokens of a request, at most; default: the model's max_position_embeddings, "
                         "at most 4096")
    sv.add_argument("--max-queue", type=_non_negative, default=256,
                    help="requests waiting for a slot, at most; more are refused with 429 and Retry-After")
    sv.add_argument("--speculative-k", type=_k_value, default="auto",
                    help=f'MTP drafts per round, 0..{MAX_SPECULATIVE_K}; 0 = plain decoding; "auto": chosen per decode '
                         "segment from the measured cost of a round at each k for the live batch and the acceptance "
                         "so far")
    sv.add_argument("--temperature", type=_temperature,
                    help="sampling temperature of a request that gives none; 0 = greedy; default 1 (0 with "
                         "--greedy-only)")
    sv.add_argument("--top-p", type=_top_p, default=1.0, help="top_p of a request that gives none; 1 = all")
    sv.add_argument("--top-k", type=_non_negative, default=0, help="top_k of a request that gives none; 0 = all")
    sv.add_argument("--max-tokens", type=_positive, default=256,
                    help="new tokens at most of a request that gives no max_tokens (and no more than --max-len leaves "
                         "after its prompt)")
    sv.add_argument("--chat-template", metavar="FILE",
                    help="Jinja chat template for /v1/chat/completions; without it, the model's (chat_template in "
                         "tokenizer_config.json), and a model without one refuses chat requests")
    sv.add_argument("--served-model-name",
                    help='the model\'s name in the API; default: the name of the checkpoint directory ("demo" for '
                         "the demo)")
    sv.add_argument("--shutdown-timeout", type=lambda text: _real(text, 0.0), default=30.0,
                    help="seconds that running requests get to finish after SIGTERM or SIGINT before they are "
                         "cancelled")
    sv.add_argument("--buckets", type=_sizes,
                    help="batch sizes compiled, comma-separated, the last = --max-batch (a replica's slots with "
                         "--replicas); a segment runs the smallest that holds the live requests, or a larger one "
                         "calibrated more than 10%% cheaper; default: the powers of two up to that")
    sv.add_argument("--prefill-chunk", type=_chunk, default=128,
                    help="prompt positions prefilled per step (a multiple of 16), and the prefix store's block")
    sv.add_argument("--prefill", choices=list(PREFILL_MODES), default="auto",
                    help="prefill prompts on a thread of their own beside the decode segments, or between them; "
                         "auto: beside on a CPU with one process and one device, between elsewhere")
    sv.add_argument("--prefix-blocks", type=_non_negative, default=64,
                    help="prompt chunks the prefix store keeps for reuse by later prompts that begin alike; 0 = none")
    sv.add_argument("--greedy-only", action="store_true",
                    help="compile the greedy programs only (a shorter start); requests with temperature > 0 are "
                         "refused")
    sv.add_argument("--quiet", action="store_true", help="no progress lines nor server logs (the ready line stays)")
    on_devices(sv)
    return parser


def _run_distributed(args):
    """jax.distributed.initialize() before anything touches the backend, then the command, with
    stdout and the progress lines of every process but the first silenced (errors still show)."""
    jax.distributed.initialize()
    if jax.process_index() == 0:
        args.run(args)
        return
    if hasattr(args, "quiet"):
        args.quiet = True
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        args.run(args)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "distributed", False):
            _run_distributed(args)
        else:
            args.run(args)
    except Exception as e:
        report = None if args.debug else _user_error(e)
        if report is None:
            raise
        parser.exit(2, f"jaxmtp {args.command}: error: {report}\n")


if __name__ == "__main__":
    main()

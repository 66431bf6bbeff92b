"""Serving: jaxmtp's OpenAI-compatible server (`jaxmtp serve`) at each speculation setting beside HF
`transformers serve --continuous-batching`, on the bundled demo model, as streaming clients see them.

Configurations (`--configs`): `plain`, `k1`, `k2`, `k3` and `auto` are `jaxmtp serve` with
`--speculative-k 0`, 1, 2, 3 and auto, `--max-batch` the largest concurrency, `--max-len` the
longest prompt plus `--max-tokens` (and 16) and `--replicas` as given (default 1); `control` (not
in the default) is a second server exactly as `plain`, whose ratio to `plain` shows how far apart two
identical servers measure on the machine; `hf` is
`transformers serve --continuous-batching` (float32, CPU; it needs the `accelerate` package) on a
temporary copy of the demo checkpoint with a tokenizer_config.json beside its tokenizer.json (HF
drops the MTP layer, which it does not run), its KV cache sized to as many positions as jaxmtp's
(`hf_blocks`). Each runs as a process of its own on a free port of 127.0.0.1. They are started one
after another, so that no start (jaxmtp compiles and measures its round costs) shares the CPU with
another (`--start-together` starts them at once), and kept running; each gets `--warmup` requests
that are not timed. Then the measured phases run in turns: for each load (each `--concurrency`, then
the Poisson `--rate`) and each of `--repeats`, every configuration in turn, the order rotated by one
from one repeat to the next, so that a busy spell of a shared machine falls on all of them alike.
Each phase records the CPU time of the whole machine, of the server and of this process, so that the
results show how busy other processes kept the machine meanwhile.

Requests: prompts cut from the shipped held-out excerpts (`jaxmtp.data.benchmark_texts`, encoded as
`jaxmtp.data.held_out_prompts` encodes them) at seeded random lengths in `--prompt-lens` and
distinct start offsets, a new set for each phase (the same set for every configuration), so that no
server sees a prompt twice and no prefix cache helps. Each asks for `--max-tokens` greedy tokens
(with `--temperature` above 0: sampled at it and `--top-p`, seeded by the prompt's index; jaxmtp's
servers only, and no outputs compared), streamed, with the end of text ignored, so that every
request generates as many: jaxmtp gets the
prompt as token ids with `ignore_eos` and streams the ids (`choices[0].token_ids`); HF's
`/v1/completions` takes text only and streams text, so it gets the prompt's text (only prompts whose
text encodes back to the same ids are used, and the prompt length HF reports is checked), with
`generation_config` `{"eos_token_id": -1}` (no EOS in its continuous batching), and its streamed
text is encoded again with the same tokenizer to give its token ids.

Per request: time to first token (TTFT: from sending the request to the first streamed chunk that
carries a token), inter-token latencies (ITL, per token: a chunk that carries n tokens g seconds
after the previous chunk counts n latencies of g / n; jaxmtp streams the tokens of several decode
steps in one chunk; HF's are one token per chunk unless it merged some, see `place_hf_tokens`), end
to end, the token ids. Per phase: output tokens/s (all the phase's completion tokens over its wall
time, from the first request sent to the last one done). Per configuration and load: the median of
those over the repeats; TTFT and ITL p50/p99 over all the requests of all the repeats. Greedy
outputs of every configuration are compared with `plain`'s (with `jaxmtp.generate(...,
speculative_k=0)`'s where `plain` is not run), request by request: token ids and text.

The results file (`--json`) holds the figures and, small, every request (`raw_phase`); raw.prompts
holds each prompt's [start, length] in the excerpts' tokens (warm-up prompts first).

    python benchmarks/serving.py [--concurrency 1,4,16,64] [--rate 1] [--requests N] [--max-tokens 64]
        [--configs plain,k1,k2,k3,auto,hf] [--repeats 2] [--json benchmarks/results/serving_cpu.json]
        [--temperature 0] [--top-p 1]
    python benchmarks/serving.py --quick   # tiny settings (tests/test_serving_benchmark.py)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import re
import sys
import tempfile
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import jaxmtp  # noqa: E402  (this checkout's)
from jaxmtp import data  # noqa: E402
from jaxmtp.provenance import write  # noqa: E402

HOST = "127.0.0.1"
# control: a second server exactly as plain, whose ratio to plain shows how far apart two identical
# servers measure on this machine (the harness's own A/A ratio), to read auto's ratio beside.
JAXMTP_K = {"plain": "0", "k1": "1", "k2": "2", "k3": "3", "auto": "auto", "control": "0"}
NAMES = (*JAXMTP_K, "hf")
CONFIGS = tuple(n for n in NAMES if n != "control")  # the default --configs
HF_NO_EOS = json.dumps({"eos_token_id": -1})  # HF's continuous batching reads a negative id as no EOS
START_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures. concurrency: the closed-loop loads; rate: the Poisson load's requests
    per second (None: none); requests: per phase (0: 2 x the concurrency, at least 48; 16 at the
    rate); prompt_lens: (shortest, longest) prompt in tokens; max_batch, max_len, replicas: jaxmtp
    serve's slots, cache length and replicas; start_together: start the servers at once (see
    --start-together)."""

    configs: tuple[str, ...]
    concurrency: tuple[int, ...]
    rate: float | None
    requests: int
    max_tokens: int
    repeats: int
    warmup: int
    prompt_lens: tuple[int, int]
    max_batch: int
    max_len: int
    seed: int
    start_together: bool = False
    replicas: int = 1
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def ask(self) -> "Ask":
        return Ask(self.max_tokens, self.temperature, self.top_p)

    def requests_at(self, load: Load) -> int:
        if self.requests:
            return self.requests
        # 48 at least: a phase of 16 requests at concurrency 1 or 4 lasted 1-2 s on the demo, and
        # the same configuration's phases then differed by up to a third on a shared machine.
        return 16 if load.rate else max(48, 2 * load.concurrency)


@dataclasses.dataclass(frozen=True)
class Ask:
    """What each request asks for: max_tokens new tokens, greedy (temperature 0) or sampled at
    temperature with top_p, seeded by its prompt's index so that a server draws the same tokens
    for it at every run."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class Load:
    """Either `concurrency` requests in flight at all times, or Poisson arrivals at `rate` per second."""

    concurrency: int = 0
    rate: float = 0.0

    @property
    def name(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"rate={self.rate:g}/s"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One request's prompt: its index in the run, its start offset in the encoded excerpts, token
    ids and text (the ids' decoding, which encodes back to the same ids)."""

    index: int
    start: int
    ids: tuple[int, ...]
    text: str


@dataclasses.dataclass
class Server:
    """A running server of one configuration: its process (leading a process group of its own),
    port, the model name it answers to, its command line and log file."""

    config: str
    process: subprocess.Popen
    port: int
    command: list[str]
    log: str
    model: str = ""
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def is_hf(self) -> bool:
        return self.config == "hf"


@dataclasses.dataclass
class Record:
    """One streamed request. sent, done: seconds from the phase's start; chunk_s: each token-carrying
    chunk's arrival, seconds after sending; chunk_tokens: tokens in each; tokens: the completion's
    ids; text, chunk_text: its streamed text, whole and by chunk; prompt_tokens / completion_tokens /
    cached_tokens: as the server's usage reports them (None where it does not); placed_by_text: see
    `place_hf_tokens`."""

    prompt: int
    prompt_len: int
    sent: float
    done: float = 0.0
    chunk_s: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    chunk_text: list[str] = dataclasses.field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    placed_by_text: bool = False

    @property
    def generated(self) -> int:
        """Tokens generated: as the server reports them, else as streamed."""
        return len(self.tokens) if self.completion_tokens is None else self.completion_tokens

    @property
    def ttft(self) -> float:
        return self.chunk_s[0]

    def itl(self) -> list[float]:
        """Per-token inter-token latencies: a chunk of n tokens g seconds after the previous one
        gives n values g / n."""
        out = []
        for before, after, n in zip(self.chunk_s, self.chunk_s[1:], self.chunk_tokens[1:]):
            out += [(after - before) / n] * n
        return out


# ----- prompts -----

def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))


def make_prompts(tok, count: int, *, lens: tuple[int, int], seed: int) -> list[Prompt]:
    """`count` prompts of seeded random lengths in `lens` (inclusive) from the shipped held-out
    excerpts at distinct start offsets, each one whose text encodes back to its ids (HF gets text)."""
    stream = data.encode(tok, data.benchmark_texts())
    if lens[0] < 1 or lens[1] < lens[0] or lens[1] >= len(stream):
        raise ValueError(f"--prompt-lens {lens[0]},{lens[1]}: expected 1 <= shortest <= longest < {len(stream)} "
                         "(the shipped prompts' tokens)")
    rng = np.random.default_rng(seed)
    starts = rng.permutation(len(stream) - lens[1])
    lengths = rng.integers(lens[0], lens[1] + 1, size=len(starts))
    prompts = []
    for start, length in zip(starts, lengths):
        ids = stream[start:start + length].tolist()
        text = tok.decode(ids, skip_special_tokens=False)
        if tok.encode(text).ids == ids:
            prompts.append(Prompt(len(prompts), int(start), tuple(ids), text))
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} of the {count} prompts asked for fit the shipped prompts' {len(stream)} "
                     "tokens at distinct start offsets with a text that encodes back to their ids: ask for fewer "
                     "requests or repeats, or shorter --prompt-lens")


# ----- servers -----

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def hf_checkpoint(workdir: str) -> str:
    """A copy of the demo checkpoint that `transformers serve` loads offline: with a tokenizer_config.json
    naming PreTrainedTokenizerFast over the bundled tokenizer.json (no text clean-up on decoding)."""
    path = os.path.join(workdir, "demo_model")
    shutil.copytree(jaxmtp.DEMO_MODEL, path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": data.END_OF_TEXT,
              "model_max_length": 1024, "clean_up_tokenization_spaces": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


def hf_blocks(settings: Settings) -> int:
    """KV-cache blocks (256 positions of every layer each) for HF: as many as --max-batch requests of
    --max-len positions take, as jaxmtp's cache holds. Left to itself on a CPU, HF sizes its cache
    (and its attention masks over it) from the free host memory: gigabytes, which a shared machine
    can lack, and masks that grow with it."""
    return settings.max_batch * -(-settings.max_len // 256)


def hf_command(workdir: str, port: int, settings: Settings) -> list[str]:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise RuntimeError("config hf: `transformers serve` places the model with a device_map, which needs the "
                           "`accelerate` package; install it or leave hf out of --configs")
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    if not os.path.exists(cli):
        raise RuntimeError(f"config hf: no `transformers` command beside {sys.executable}")
    return [cli, "serve", hf_checkpoint(workdir), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--cb-num-blocks", str(hf_blocks(settings)), "--host", HOST, "--port", str(port), "--log-level", "warning"]


def jaxmtp_command(config: str, port: int, settings: Settings) -> list[str]:
    return [sys.executable, "-m", "jaxmtp.cli", "serve", jaxmtp.DEMO_MODEL, "--host", HOST, "--port", str(port),
            "--speculative-k", JAXMTP_K[config], "--max-batch", str(settings.max_batch),
            "--max-len", str(settings.max_len), "--replicas", str(settings.replicas), "--quiet"]


def launch(config: str, settings: Settings, workdir: str) -> Server:
    """Starts a configuration's server process (without waiting for it)."""
    port = free_port()
    command = hf_command(workdir, port, settings) if config == "hf" else jaxmtp_command(config, port, settings)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ROOT}
    log = os.path.join(workdir, f"{config}.log")
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                   start_new_session=True)
    return Server(config, process, port, command, log, startup_s=time.perf_counter())


def ready(server: Server) -> None:
    """Waits until the server answers GET /v1/models; its model name and start-up time then."""
    server.model = wait_ready(server)
    server.startup_s = time.perf_counter() - server.startup_s
    print(f"{server.config}: ready in {server.startup_s:.1f} s (port {server.port})", flush=True)


def start_all(settings: Settings, workdir: str, servers: list[Server]) -> None:
    """Starts the servers into `servers` (so that the caller stops whichever started): one after
    another, each once the last answers, or all at once with `settings.start_together`."""
    if settings.start_together:
        servers += [launch(config, settings, workdir) for config in settings.configs]
        for server in servers:
            ready(server)
        return
    for config in settings.configs:
        servers.append(launch(config, settings, workdir))
        ready(servers[-1])


def log_tail(server: Server, lines: int = 30) -> str:
    with open(server.log, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def wait_ready(server: Server) -> str:
    """The model name the server lists, once it answers; refuses if it exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"config {server.config}: the server exited with status {server.process.returncode} "
                               f"({' '.join(server.command)}); its log ends:\n{log_tail(server)}")
        try:
            listed = httpx.get(server.url + "/v1/models", timeout=5).json()["data"]
            return listed[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            time.sleep(1)
    stop(server)
    raise RuntimeError(f"config {server.config}: no answer within {START_TIMEOUT_S:.0f} s; its log ends:\n"
                       f"{log_tail(server)}")


def stop(server: Server) -> None:
    """SIGTERM to the server's process group (HF runs its model in a child process), SIGKILL after 20 s."""
    if server.process.poll() is not None:
        return
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


# ----- the client -----

def request_body(server: Server, prompt: Prompt, ask: Ask) -> dict:
    body = {"model": server.model, "max_tokens": ask.max_tokens, "temperature": ask.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if ask.temperature > 0:
        body.update(top_p=ask.top_p, seed=prompt.index)
    if server.is_hf:
        return {**body, "prompt": prompt.text, "generation_config": HF_NO_EOS}
    return {**body, "prompt": list(prompt.ids), "ignore_eos": True}


def take_event(server: Server, record: Record, event: dict, at: float) -> None:
    """Adds one streamed event (an OpenAI completion chunk) to `record`."""
    usage = event.get("usage")
    if usage:
        record.prompt_tokens, record.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for choice in event.get("choices") or []:
        text = choice.get("text") or ""
        if server.is_hf:
            if text:
                record.chunk_s.append(at)
                record.chunk_text.append(text)
            continue
        if "token_ids" not in choice:
            raise RuntimeError(f"config {server.config}: a streamed chunk has no choices[0].token_ids: {event}")
        if choice["token_ids"]:
            record.chunk_s.append(at)
            record.chunk_tokens.append(len(choice["token_ids"]))
            record.tokens += choice["token_ids"]
            record.chunk_text.append(text)


async def one_request(client: httpx.AsyncClient, server: Server, prompt: Prompt, ask: Ask,
                      phase_start: float) -> Record:
    """Sends one streaming completion and records its chunks as they arrive."""
    sent = time.perf_counter()
    record = Record(prompt.index, len(prompt.ids), sent - phase_start)
    async with client.stream("POST", server.url + "/v1/completions",
                             json=request_body(server, prompt, ask)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"config {server.config}: HTTP {response.status_code}: {(await response.aread())[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"config {server.config}: the stream failed: {event['error']}")
            take_event(server, record, event, time.perf_counter() - sent)
    record.done = time.perf_counter() - phase_start
    record.text = "".join(record.chunk_text)
    if not record.chunk_s:
        raise RuntimeError(f"config {server.config}: prompt {prompt.index} streamed no token")
    return record


async def closed_loop(server: Server, prompts: list[Prompt], concurrency: int, ask: Ask) -> list[Record]:
    """`concurrency` clients, each sending its next prompt as soon as its last one is done."""
    queue = list(reversed(prompts))
    records = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        start = time.perf_counter()

        async def worker():
            while queue:
                records.append(await one_request(client, server, queue.pop(), ask, start))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.prompt)


async def poisson(server: Server, prompts: list[Prompt], rate: float, ask: Ask, seed: int) -> list[Record]:
    """Requests sent at Poisson arrival times of `rate` per second (seeded), however many are in flight."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(prompts)))
    arrivals -= arrivals[0]
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def at(delay, prompt):
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            return await one_request(client, server, prompt, ask, start)

        return list(await asyncio.gather(*(at(d, p) for d, p in zip(arrivals, prompts))))


def place_hf_tokens(tok, record: Record) -> None:
    """HF streams text: its token ids are the text encoded again. Where it streamed a chunk per
    token (as many chunks as the completion tokens it reports), each chunk holds one; where it
    merged some (a stream that fell behind sends what is queued as one chunk), each token is counted
    in the chunk in which its text ends (`placed_by_text`)."""
    encoding = tok.encode(record.text)
    record.tokens = list(encoding.ids)
    if len(record.chunk_s) == record.completion_tokens:
        record.chunk_tokens = [1] * len(record.chunk_s)
        return
    record.placed_by_text = True
    ends = np.cumsum([len(t) for t in record.chunk_text])
    chunk_of = np.searchsorted(ends, [end for _, end in encoding.offsets], side="left")
    counts = np.bincount(chunk_of, minlength=len(ends)).tolist()
    keep = [i for i, n in enumerate(counts) if n]  # a chunk in which no token's text ends joins the next
    record.chunk_s = [record.chunk_s[i] for i in keep]
    record.chunk_tokens = [counts[i] for i in keep]


def run_phase(server: Server, prompts: list[Prompt], load: Load, settings: Settings, tok) -> dict:
    """One measured phase: the load's requests to one server; its records, wall time and CPU use."""
    cpu_before = cpu_seconds(server)
    counts_before = engine_counts(server)
    began = time.perf_counter()
    if load.concurrency:
        records = asyncio.run(closed_loop(server, prompts, load.concurrency, settings.ask))
    else:
        records = asyncio.run(poisson(server, prompts, load.rate, settings.ask, settings.seed))
    wall = time.perf_counter() - began
    cpu_after = cpu_seconds(server)
    for record in records:
        if server.is_hf:
            place_hf_tokens(tok, record)
        elif record.completion_tokens not in (None, len(record.tokens)):
            raise RuntimeError(f"config {server.config}: prompt {record.prompt} streamed {len(record.tokens)} token "
                               f"ids but its usage counts {record.completion_tokens}")
    cpu = None if cpu_before is None else {name: cpu_after[name] - cpu_before[name] for name in cpu_before}
    counts = {"rounds_by_k": None, "segments_by_bucket": None}
    if counts_before is not None:
        after = engine_counts(server)
        counts = {name: {label: n - counts_before[name].get(label, 0) for label, n in after[name].items()
                         if n - counts_before[name].get(label, 0)} for name in after}
    return {"config": server.config, "load": load.name, "wall_s": wall, "cpu_s": cpu, **counts,
            "records": records}


def engine_counts(server: Server) -> dict[str, dict[str, float]] | None:
    """jaxmtp's decode rounds so far by k and its decode segments by batch bucket (its /metrics
    counters); None for HF's server."""
    if server.is_hf:
        return None
    text = httpx.get(server.url + "/metrics", timeout=30).text

    def counter(name: str, label: str) -> dict[str, float]:
        return {m.group(1): float(m.group(2))
                for m in re.finditer(rf'^{name}\{{{label}="(\d+)"\}} (\S+)$', text, re.MULTILINE)}

    return {"rounds_by_k": counter("jaxmtp_speculative_rounds_total", "k"),
            "segments_by_bucket": counter("jaxmtp_decode_segments_total", "bucket")}


# ----- CPU use (Linux's /proc), to show how busy the shared machine was during a phase -----

def _stat_fields(pid) -> list[str]:
    """/proc/PID/stat's fields after the command name (the state is [0], the parent [1])."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(_stat_fields(entry)[1])
        except OSError:  # it exited meanwhile
            continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _tree_cpu(pid: int) -> float:
    total = 0
    for member in _tree(pid):
        try:
            fields = _stat_fields(member)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


def cpu_seconds(server: Server) -> dict | None:
    """CPU seconds so far of the whole machine (all cores, all processes, from /proc/stat), of the
    server's process tree and of this process (the load generator); None off Linux."""
    if not os.path.exists("/proc/stat"):
        return None
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user .. steal less idle and iowait (guest time is in user's)
    return {"machine": busy / os.sysconf("SC_CLK_TCK"), "server": _tree_cpu(server.process.pid),
            "client": time.process_time()}


# ----- figures -----

def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def other_cores(phase: dict) -> float | None:
    """Cores that processes other than the server and the client kept busy on average during a phase
    (other servers idling, other work on a shared machine)."""
    cpu = phase["cpu_s"]
    return None if cpu is None else (cpu["machine"] - cpu["server"] - cpu["client"]) / phase["wall_s"]


def summarise(phases: list[dict]) -> dict:
    """A configuration's figures at one load from its phases (one per repeat)."""
    records = [r for phase in phases for r in phase["records"]]
    rates = [sum(r.generated for r in phase["records"]) / phase["wall_s"] for phase in phases]
    ttft = [r.ttft for r in records]
    itl = [x for r in records for x in r.itl()]
    others = [other_cores(phase) for phase in phases]
    return {"output_tokens_per_s": statistics.median(rates), "output_tokens_per_s_by_repeat": rates,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "e2e_p50_s": percentile([r.done - r.sent for r in records], 50),
            "tokens_per_chunk": sum(len(r.tokens) for r in records) / sum(len(r.chunk_s) for r in records),
            "requests": len(records), "placed_by_text": sum(r.placed_by_text for r in records),
            "other_cores": None if None in others else max(others)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(phases: list[dict], reference: dict[int, list[int]], tok) -> dict:
    """Every configuration's greedy outputs against the reference, by prompt: how many have the same
    token ids and how many the same text (the reference's ids decoded), and each whose ids differ.
    HF's ids are its streamed text encoded again, which merges tokens that the model generated
    apart (e.g. two newline tokens where one token covers both): the same text, other ids."""
    matched, mismatches = {}, []
    for phase in phases:
        count = matched.setdefault(phase["config"], {"compared": 0, "same_tokens": 0, "same_text": 0})
        for r in phase["records"]:
            want = reference[r.prompt]
            same_text = r.text == tok.decode(want)
            count["compared"] += 1
            count["same_tokens"] += r.tokens == want
            count["same_text"] += same_text
            if r.tokens != want:
                mismatches.append({"config": phase["config"], "load": phase["load"], "prompt": r.prompt,
                                   "first_difference": first_difference(r.tokens, want), "same_text": same_text,
                                   "tokens": r.tokens, "reference": want})
    return {"matched": matched, "mismatches": mismatches}


def hf_prompt_checks(phases: list[dict]) -> list[dict]:
    """Requests whose prompt length as HF counted it differs from the ids the text came from."""
    return [{"prompt": r.prompt, "ids": r.prompt_len, "hf_prompt_tokens": r.prompt_tokens}
            for phase in phases if phase["config"] == "hf" for r in phase["records"] if r.prompt_tokens != r.prompt_len]


def generate_reference(prompts: list[Prompt], max_tokens: int) -> dict[int, list[int]]:
    """Plain greedy tokens of each prompt by `jaxmtp.generate` in this process (where `plain` is not run)."""
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    return {p.index: jaxmtp.generate(model, [list(p.ids)], max_new_tokens=max_tokens, speculative_k=0,
                                     eos_token_id=None).tokens[0] for p in prompts}


# ----- the run -----

def loads_of(settings: Settings) -> list[Load]:
    return [Load(concurrency=c) for c in settings.concurrency] + ([Load(rate=settings.rate)] if settings.rate else [])


def plan_prompts(settings: Settings, tok) -> tuple[list[Prompt], list[Prompt], dict]:
    """All the run's prompts: warm-up ones per server, and a set per (load, repeat) shared by the configs."""
    loads = loads_of(settings)
    warm = settings.warmup * len(settings.configs)
    count = warm + settings.repeats * sum(settings.requests_at(load) for load in loads)
    prompts = make_prompts(tok, count, lens=settings.prompt_lens, seed=settings.seed)
    sets, at = {}, warm
    for load in loads:
        for repeat in range(settings.repeats):
            sets[load.name, repeat] = prompts[at:at + settings.requests_at(load)]
            at += settings.requests_at(load)
    return prompts, prompts[:warm], sets


def warm_up(servers: list[Server], prompts: list[Prompt], settings: Settings) -> None:
    """`settings.warmup` requests to each server, all at once, not timed."""
    for i, server in enumerate(servers):
        mine = prompts[i * settings.warmup:(i + 1) * settings.warmup]
        asyncio.run(closed_loop(server, mine, len(mine), settings.ask))


def measure(servers: list[Server], sets: dict, settings: Settings, tok) -> list[dict]:
    """Every load, repeat and server, the servers' order rotated by one each repeat."""
    phases = []
    for li, load in enumerate(loads_of(settings)):
        for repeat in range(settings.repeats):
            turn = (li + repeat) % len(servers)
            for position, server in enumerate(servers[turn:] + servers[:turn]):
                phase = run_phase(server, sets[load.name, repeat], load, settings, tok)
                phases.append({**phase, "repeat": repeat, "position": position})
                print(f"{load.name:>10} repeat {repeat} {server.config:>5}: "
                      f"{summarise([phase])['output_tokens_per_s']:8.1f} output tokens/s ({phase['wall_s']:.1f} s)",
                      flush=True)
    return phases


def invocation(server: Server, settings: Settings) -> str:
    """The server's command line without its paths, host and port."""
    if server.is_hf:
        return (f"transformers serve DEMO_COPY --continuous-batching --device cpu --dtype float32 "
                f"--cb-num-blocks {hf_blocks(settings)}")
    replicas = f" --replicas {settings.replicas}" if settings.replicas > 1 else ""
    return (f"jaxmtp serve DEMO --speculative-k {JAXMTP_K[server.config]} --max-batch {settings.max_batch} "
            f"--max-len {settings.max_len}{replicas}")


def figures_of(settings: Settings, servers: list[Server], phases: list[dict], greedy: dict, tok) -> dict:
    rows = []
    for load in loads_of(settings):
        for server in servers:
            mine = [p for p in phases if p["config"] == server.config and p["load"] == load.name]
            rows.append({"config": server.config, "load": load.name, "concurrency": load.concurrency or None,
                         "rate": load.rate or None, **summarise(mine)})
    configs = {s.config: {"invocation": invocation(s, settings), "startup_s": s.startup_s,
                          "speculative_k": None if s.is_hf else JAXMTP_K[s.config], "command": " ".join(s.command)}
               for s in servers}
    if "hf" in configs:
        import torch
        import transformers

        configs["hf"].update({"transformers": transformers.__version__, "torch": torch.__version__,
                              "endpoint": "/v1/completions (prompt as text, streamed text encoded again)"})
    return {"model": "demo_model", "prompts_sha256": data.prompts_sha256(),
            "prompts": f"prompts of {settings.prompt_lens[0]}..{settings.prompt_lens[1]} tokens (seeded lengths, "
                       "distinct offsets) cut from the held-out excerpts",
            "max_tokens": settings.max_tokens, "temperature": settings.temperature, "top_p": settings.top_p,
            "repeats": settings.repeats, "warmup": settings.warmup,
            "seed": settings.seed, "max_batch": settings.max_batch, "max_len": settings.max_len,
            "replicas": settings.replicas, "start_together": settings.start_together,
            "configs": configs, "rows": rows, "greedy": greedy,
            "hf_prompt_length_mismatches": hf_prompt_checks(phases)}


def ids_sha256(ids) -> str:
    """A short hash of token ids (the first 16 hex digits of the sha256 of their JSON list)."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def raw_phase(phase: dict) -> dict:
    """A phase as the results file keeps it, small: per request its prompt (an index into
    raw.prompts), when it was sent and done (seconds from the phase's start), its chunks' arrivals
    (ms after sending, to 0.1 ms) and token counts as space-separated text, the tokens generated and
    the prompt tokens as the server counts them, and the hash of its ids (`ids_sha256`); the prompt
    tokens the server took from a prefix cache, all requests together (None where it does not say)."""
    records = phase["records"]
    cached = [r.cached_tokens for r in records]
    requests = [{"prompt": r.prompt, "sent": round(r.sent, 4), "done": round(r.done, 4),
                 "chunk_ms": " ".join(f"{1e3 * t:.1f}" for t in r.chunk_s),
                 "chunk_tokens": " ".join(map(str, r.chunk_tokens)), "generated": r.generated,
                 "prompt_tokens": r.prompt_tokens, "ids_sha256": ids_sha256(r.tokens)} for r in records]
    return {**{k: v for k, v in phase.items() if k != "records"},
            "cached_prompt_tokens": None if None in cached else sum(cached), "requests": requests}


def greedy_outputs(settings: Settings, phases: list[dict], measured: list[Prompt], tok) -> dict:
    """Every configuration's outputs against plain's (or jaxmtp.generate's), where they are greedy;
    sampled, each setting draws its own tokens and nothing is compared (reference None)."""
    if settings.temperature > 0:
        return {"reference": None, "matched": {}, "mismatches": []}
    if "plain" in settings.configs:
        reference = {r.prompt: r.tokens for p in phases if p["config"] == "plain" for r in p["records"]}
        return {"reference": "plain", **compare(phases, reference, tok)}
    reference = generate_reference(measured, settings.max_tokens)
    return {"reference": "jaxmtp.generate(speculative_k=0)", **compare(phases, reference, tok)}


def run(settings: Settings, workdir: str) -> tuple[dict, dict]:
    tok = tokenizer()
    prompts, warm, sets = plan_prompts(settings, tok)
    servers = []
    try:
        start_all(settings, workdir, servers)
        warm_up(servers, warm, settings)
        phases = measure(servers, sets, settings, tok)
    finally:
        for server in servers:
            stop(server)
    greedy = greedy_outputs(settings, phases, [p for p in prompts if p not in warm], tok)
    figures = figures_of(settings, servers, phases, greedy, tok)
    raw = {"prompts": [[p.start, len(p.ids)] for p in prompts],
           "phases": [raw_phase(phase) for phase in phases]}
    return figures, raw


def report(figures: dict) -> None:
    print(f"\n{'config':>6} {'load':>10} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}  (ms)")
    for r in figures["rows"]:
        print(f"{r['config']:>6} {r['load']:>10} {r['output_tokens_per_s']:8.1f} {r['ttft_p50_ms']:9.1f} "
              f"{r['ttft_p99_ms']:8.1f} {r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f}")
    greedy = figures["greedy"]
    for config, n in greedy["matched"].items():
        print(f"greedy {config}: of {n['compared']}, {n['same_tokens']} with the same token ids as "
              f"{greedy['reference']}, {n['same_text']} with the same text")
    for m in greedy["mismatches"]:
        print(f"  ids differ: {m['config']} {m['load']} prompt {m['prompt']} from token {m['first_difference']} "
              f"({'same' if m['same_text'] else 'different'} text)")


# ----- the command line -----

def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, comma-separated")
    return values


def _configs(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    unknown = [n for n in names if n not in NAMES]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct names from {','.join(NAMES)}")
    return names


def parse(argv=None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=_configs, default=CONFIGS,
                        help=f"comma-separated from {','.join(NAMES)} (default: all but control)")
    parser.add_argument("--concurrency", type=_ints, default=(1, 4, 16, 64), help="closed-loop loads")
    parser.add_argument("--rate", type=float, help="also a Poisson load of this many requests per second")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per phase (default: 2 x the concurrency, at least 48; 16 at --rate)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="above 0: every request samples at it, seeded by its prompt, and no outputs are compared "
                             "(each setting draws its own tokens); jaxmtp's servers only")
    parser.add_argument("--top-p", type=float, default=1.0, help="of the sampled requests")
    parser.add_argument("--repeats", type=int, default=2, help="phases per configuration and load")
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests per server before measuring")
    parser.add_argument("--prompt-lens", type=_ints, default=(32, 512), help="shortest,longest prompt in tokens")
    parser.add_argument("--max-batch", type=int, help="jaxmtp serve --max-batch (default: the largest concurrency)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="jaxmtp serve --replicas (engines of --max-batch / N slots each); must divide --max-batch")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts' lengths and offsets and the arrivals")
    parser.add_argument("--start-together", action="store_true",
                        help="start the servers at once, not one after another: quicker, but their compiles and "
                             "auto's measuring of round costs then share the CPU (auto may choose worse)")
    parser.add_argument("--json", help="write the figures and raw records, with their provenance, here")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings for the test: concurrency 1,2, 3 requests, 8 tokens, prompts of 16..64, "
                             "1 repeat, 1 warm-up request, --start-together, configs plain,auto unless --configs")
    args = parser.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        args.configs = args.configs if "--configs" in given else ("plain", "auto")
        args.concurrency, args.requests, args.max_tokens, args.repeats = (1, 2), 3, 8, 1
        args.warmup, args.prompt_lens, args.rate, args.start_together = 1, (16, 64), None, True
    if args.rate is not None and args.rate <= 0:
        parser.error(f"--rate {args.rate}: expected a positive number of requests per second")
    for name in ("requests", "max_tokens", "repeats", "warmup", "max_batch", "replicas"):
        value = getattr(args, name)
        if value is not None and value < (0 if name in ("requests", "warmup") else 1):
            parser.error(f"--{name.replace('_', '-')} {value}: out of range")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error(f"--temperature {args.temperature} --top-p {args.top_p}: expected temperature >= 0 and "
                     "0 < top-p <= 1")
    if args.temperature > 0 and "hf" in args.configs:
        parser.error("--temperature: the hf config runs greedy requests only (its outputs are compared with jaxmtp's)")
    if len(args.prompt_lens) != 2:
        parser.error(f"--prompt-lens {args.prompt_lens}: expected two lengths, shortest,longest")
    settings = Settings(configs=args.configs, concurrency=args.concurrency, rate=args.rate, requests=args.requests,
                        max_tokens=args.max_tokens, repeats=args.repeats, warmup=args.warmup,
                        prompt_lens=args.prompt_lens, max_batch=args.max_batch or max(args.concurrency),
                        max_len=args.prompt_lens[1] + args.max_tokens + 16, seed=args.seed,
                        start_together=args.start_together, replicas=args.replicas, temperature=args.temperature,
                        top_p=args.top_p)
    if settings.max_batch % settings.replicas:
        parser.error(f"--replicas {settings.replicas}: does not divide --max-batch {settings.max_batch}")
    return settings, args


def main(argv=None):
    settings, args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="serving-") as workdir:
        figures, raw = run(settings, workdir)
    report(figures)
    if args.json:
        write(args.json, "serving", figures, raw, settings.repeats, prompts_sha256=data.prompts_sha256())


if __name__ == "__main__":
    main()

"""`jaxmtp serve`: a real `openai` client against a live server on 127.0.0.1 (a subprocess
serving the bundled demo model), checked against `jaxmtp.generate` of each prompt alone (greedy,
plain decoding) as the independent reference, and against the chat template rendered here with
jinja2 directly.

One server per module, with two decode slots, so that requests share decode segments and wait in
the queue (the engine compiles its programs per batch bucket, so more slots cost more start-up); a
second, with one queue place, for the full queue, a model without a chat template and SIGTERM. Both
share the test run's compile cache (tests/conftest.py), so the second loads what the first compiled.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import jinja2
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

import jaxmtp
from jaxmtp.serve.text import IncrementalText

ROOT = pathlib.Path(__file__).resolve().parent.parent
EOS = 0  # the demo's eos_token_id (config.json; it has no generation_config.json)
MOST = 12  # new tokens of the references; requests ask for up to this many
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", [484, 288, 1521, 269], [50, 51, 52, 53, 54, 55]]
TEMPLATE = "{% for m in messages %}# {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}# assistant\n"
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


class Server:
    """A `jaxmtp serve MODEL` subprocess (the demo model by default) on a free port; its stderr in a file."""

    def __init__(self, log: pathlib.Path, *flags: str, model: str = "demo"):
        self.log, self.model = log, model
        with open(log, "w") as stderr:
            command = [sys.executable, "-m", "jaxmtp.cli", "serve", model, "--port", "0", *flags]
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        self.url = None

    def ready(self, timeout: float = 900) -> "Server":
        """Waits for the ready line -> self, its url set."""
        self.url = self._ready(timeout)
        return self

    def _ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(rf"serving {re.escape(self.model)} at (http://\S+)", self.log.read_text())
            if found:
                return found.group(1)
            assert self.process.poll() is None, f"the server exited:\n{self.tail()}"
            time.sleep(0.2)
        raise AssertionError(f"the server was not ready after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """/metrics' samples: {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def settled(self, timeout: float = 30) -> dict[str, float]:
        """/metrics once no request waits or runs (or as it is after `timeout` s)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["jaxmtp_requests_running"], m["jaxmtp_requests_waiting"]) == (0, 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))


@pytest.fixture(scope="module")
def reference():
    """ids -> (the first MOST greedy tokens of the prompt alone, with plain decoding, stopping at
    EOS; their log-probabilities)."""
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    cache = {}

    def solo(ids: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(ids)
        if key not in cache:
            out = jaxmtp.generate(model, [ids], max_new_tokens=MOST, speculative_k=0, eos_token_id=EOS,
                                  return_logprobs=True)
            cache[key] = out.tokens[0], out.logprobs[0]
        return cache[key]

    return solo


@pytest.fixture(scope="module")
def server(tmp_path_factory, reference, tokenizer):
    directory = tmp_path_factory.mktemp("serve")
    (directory / "chat.jinja").write_text(TEMPLATE)
    # k = 1 rather than auto (here and in the SIGTERM test's server, which loads these programs from
    # the compile cache): its programs and calibration cost less; the engine tests run auto.
    s = Server(directory / "server.log", "--max-batch", "2", "--buckets", "2", "--max-len", "512", "--chat-template",
               str(directory / "chat.jinja"), "--speculative-k", "1")
    try:
        for prompt in [*PROMPTS, _chat_prompt(tokenizer)]:  # while the server starts
            reference(_ids(prompt, tokenizer))
        yield s.ready()
    finally:
        s.stop()
    assert s.process.returncode == 0 and "Traceback" not in s.log.read_text(), s.tail()


def _chat_prompt(tokenizer) -> list[int]:
    """MESSAGES as TEMPLATE writes them, encoded without special tokens (the template would write them)."""
    rendered = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False).ids


def _ids(prompt, tokenizer) -> list[int]:
    return prompt if isinstance(prompt, list) else tokenizer.encode(prompt).ids


def _expected(reference, prompt, tokenizer, max_tokens: int) -> list[int]:
    """What a greedy request for max_tokens new tokens must return: the reference's first
    max_tokens (it ends at EOS, if that comes first)."""
    return reference(_ids(prompt, tokenizer))[0][:max_tokens]


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2]], ids=["text", "token-ids"])
def test_completion_equals_solo_greedy_reference(server, reference, tokenizer, prompt):
    client = server.client()
    want = _expected(reference, prompt, tokenizer, MOST)
    whole = client.completions.create(model="demo", prompt=prompt, max_tokens=MOST, temperature=0)
    choice = whole.choices[0]
    assert choice.token_ids == want
    assert choice.text == tokenizer.decode(want)
    assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(_ids(prompt, tokenizer)), len(want))
    assert whole.object == "text_completion" and whole.model == "demo"

    chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=MOST, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == choice.text
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want) and not chunks[-1].choices


def test_stop_string_cuts_the_text_in_both_forms(server, reference, tokenizer):
    client = server.client()
    full = tokenizer.decode(_expected(reference, PROMPTS[0], tokenizer, MOST))
    stop = full.strip()[4:7]  # three characters from inside the greedy text
    want = full[:full.index(stop)]
    whole = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=MOST, temperature=0, stop=stop)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=MOST, temperature=0, stop=[stop],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_logprobs_are_the_chosen_tokens(server, reference, tokenizer):
    client = server.client()
    tokens, logprobs = reference(PROMPTS[3])
    out = client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=MOST, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].token_ids == tokens
    assert lp.tokens == [tokenizer.decode([t]) for t in tokens]
    np.testing.assert_allclose(lp.token_logprobs, logprobs, atol=1e-4)
    with pytest.raises(openai.BadRequestError, match="only the chosen token"):
        client.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=4, logprobs=2)


def test_chat_renders_the_given_template(server, reference, tokenizer):
    client = server.client()
    prompt = _chat_prompt(tokenizer)
    want, logprobs = reference(prompt)
    whole = client.chat.completions.create(model="demo", messages=MESSAGES, max_completion_tokens=MOST, temperature=0,
                                           logprobs=True)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.token_ids == want and choice.message.content == tokenizer.decode(want)
    assert whole.usage.prompt_tokens == len(prompt)
    np.testing.assert_allclose([c.logprob for c in choice.logprobs.content], logprobs, atol=1e-4)

    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=MOST, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


LONG = [5] * 600  # more tokens than the server's --max-len 512
BAD = [  # (body, the field the 400 must name)
    ('{"prompt": "x", "max_tokens": 4', None),  # malformed JSON
    ({"prompt": "x", "max_tokens": 4, "colour": "blue"}, "colour"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 512}, "max_tokens"),  # the prompt plus 512 exceed 512
    ({"prompt": LONG, "max_tokens": 4}, "prompt"),
    ({"prompt": [3, 2048], "max_tokens": 4}, "prompt"),  # the demo's vocabulary is 0..2047
    ({"prompt": ["x", "y"], "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "stop_token_ids": [[9999]]}, "stop_token_ids"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_request_is_a_400_naming_the_field(server, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_bad_chat_request_names_the_field(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="demo", messages=[{"role": "wizard", "content": "x"}])
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, max_completion_tokens=4)
    assert bad.value.body["param"] == "max_tokens"


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client().models.list()] == ["demo"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = server.metrics()
    assert m["jaxmtp_slots"] == 2
    for name in ("jaxmtp_requests_waiting", "jaxmtp_prompt_tokens_total", "jaxmtp_cached_prompt_tokens_total",
                 "jaxmtp_generation_tokens_total", "jaxmtp_draft_tokens_total", "jaxmtp_accepted_draft_tokens_total",
                 "jaxmtp_time_to_first_token_seconds_count", "jaxmtp_inter_token_latency_seconds_count",
                 "jaxmtp_e2e_request_latency_seconds_count"):
        assert name in m
    segments = {name: n for name, n in m.items() if name.startswith("jaxmtp_decode_segments_total")}
    assert set(segments) <= {f'jaxmtp_decode_segments_total{{bucket="{b}"}}' for b in (1, 2)}  # the 2 slots' buckets


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    cancelled = 'jaxmtp_requests_finished_total{reason="cancelled"}'
    before = server.settled().get(cancelled, 0)
    stream = server.client().completions.create(model="demo", prompt=PROMPTS[1], max_tokens=480, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].token_ids
    stream.close()
    after = server.settled()
    assert (after["jaxmtp_requests_running"], after["jaxmtp_requests_waiting"]) == (0, 0)
    assert after[cancelled] == before + 1


def test_a_client_that_leaves_before_its_whole_response_cancels_it(server):
    """A whole (not streamed) request whose client closes its connection while it runs ends as
    cancelled. Its 500 tokens take the demo a second or two: on a loaded machine the request can
    end by length before the server reads the close, and then the test tries again (three times)."""
    cancelled, length = (f'jaxmtp_requests_finished_total{{reason="{r}"}}' for r in ("cancelled", "length"))
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 500, "temperature": 0, "ignore_eos": True}).encode()
    for _ in range(3):
        before = server.settled()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 60
            while server.metrics()["jaxmtp_requests_running"] != 1:  # it prefills or decodes: now leave
                assert time.monotonic() < deadline
        after = server.settled()
        assert (after["jaxmtp_requests_running"], after["jaxmtp_requests_waiting"]) == (0, 0)
        if after.get(length, 0) == before.get(length, 0):
            break
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1
    assert after.get(length, 0) == before.get(length, 0)


async def _load(server: Server, reference, tokenizer, requests: int = 200, concurrency: int = 48) -> dict:
    """`requests` requests, `concurrency` at a time: greedy ones whole and streamed (checked
    against their references), sampled ones, streams left after their first chunk, and bad ones;
    /health asked now and then meanwhile. -> counts of each kind that behaved."""
    client = server.async_client()
    gate = asyncio.Semaphore(concurrency)
    done = {"greedy": 0, "streamed": 0, "sampled": 0, "left": 0, "refused": 0, "healthy": 0}

    async def one(i: int):
        prompt, max_tokens, kind = PROMPTS[i % len(PROMPTS)], 4 + i % (MOST - 3), i % 10
        common = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens}
        async with gate:
            if kind < 5:
                out = await client.completions.create(**common, temperature=0)
                assert out.choices[0].token_ids == _expected(reference, prompt, tokenizer, max_tokens), i
                done["greedy"] += 1
            elif kind < 7:
                chunks = [c async for c in await client.completions.create(**common, temperature=0, stream=True)]
                want = _expected(reference, prompt, tokenizer, max_tokens)
                assert [t for c in chunks for t in c.choices[0].token_ids] == want, i
                assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(want), i
                done["streamed"] += 1
            elif kind == 7:
                out = await client.completions.create(**common, temperature=0.8, top_p=0.9, seed=i)
                assert 1 <= len(out.choices[0].token_ids) <= max_tokens
                assert out.choices[0].finish_reason in ("stop", "length")
                done["sampled"] += 1
            elif kind == 8:
                stream = await client.completions.create(**{**common, "max_tokens": 200}, temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True})
                async for _ in stream:
                    break
                await stream.close()
                done["left"] += 1
            else:
                bad = [{"temperature": -1}, {"n": 3}, {"extra_body": {"colour": "blue"}}][i % 3]
                with pytest.raises(openai.BadRequestError):
                    await client.completions.create(**common, **bad)
                done["refused"] += 1

    async def health(http: httpx.AsyncClient):
        for _ in range(10):
            await asyncio.sleep(0.2)
            if (await http.get(server.url + "/health")).status_code == 200:
                done["healthy"] += 1

    async with httpx.AsyncClient() as http:
        await asyncio.wait_for(asyncio.gather(health(http), *(one(i) for i in range(requests))), timeout=600)
    await client.close()
    return done


def test_load_every_valid_request_completes_and_the_server_ends_idle(server, reference, tokenizer):
    ended, first, prompt = ("jaxmtp_e2e_request_latency_seconds_count", "jaxmtp_time_to_first_token_seconds_count",
                            "jaxmtp_prompt_tokens_total")
    before = server.settled()
    done = asyncio.run(_load(server, reference, tokenizer))
    assert done == {"greedy": 100, "streamed": 40, "sampled": 20, "left": 20, "refused": 20, "healthy": 10}
    after = server.settled()
    assert (after["jaxmtp_requests_running"], after["jaxmtp_requests_waiting"]) == (0, 0)
    valid = [i for i in range(200) if i % 10 != 9]  # the 180 admitted: each ended once, each had a first token
    deadline = time.monotonic() + 10  # the last ends are counted as their events arrive
    while after[ended] - before[ended] < len(valid) and time.monotonic() < deadline:
        after = server.metrics()
    assert after[ended] - before[ended] == after[first] - before[first] == len(valid)
    assert after[prompt] - before[prompt] == sum(len(_ids(PROMPTS[i % len(PROMPTS)], tokenizer)) for i in valid)


def test_full_queue_no_template_and_sigterm(tmp_path):
    """A server with one queue place (greedy programs only: its requests are greedy, and it starts
    sooner): a request beyond it is refused with 429 and Retry-After; a chat request is refused for
    want of a template; SIGTERM with requests in flight answers 503 to new ones, ends the running
    ones (finished or cancelled, never hanging) and exits with 0."""
    s = Server(tmp_path / "server.log", "--max-batch", "2", "--buckets", "2", "--max-len", "512", "--max-queue", "1",
               "--shutdown-timeout", "1", "--speculative-k", "1", "--greedy-only").ready()
    try:
        client = s.client()
        with pytest.raises(openai.BadRequestError, match="--chat-template"):
            client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4)
        streams = []
        for n in range(3):  # two running (each has sent a token), then one waiting
            streams.append(client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=480, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
            if n < 2:
                assert next(iter(streams[-1])).choices[0].token_ids
        assert s.metrics()["jaxmtp_requests_waiting"] == 1
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"

        s.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        for stream in streams:  # each ends with a finish reason; the cancelled ones say so
            reasons = [c.choices[0].finish_reason for c in stream if c.choices]
            assert reasons[-1] in ("length", "cancelled")
        assert s.process.wait(60) == 0, s.tail()
    finally:
        s.stop()


def test_incremental_text_sends_no_partial_character_nor_a_stop_string(tokenizer):
    text = 'print("naïve café ☕ — 日本語")  # STOP here'
    ids = tokenizer.encode(text).ids
    pieces = IncrementalText(tokenizer)
    sent = [pieces.add([t]) for t in ids] + [pieces.add([], final=True)]
    assert "".join(sent) == tokenizer.decode(ids) and not any("\ufffd" in s for s in sent)
    cut = IncrementalText(tokenizer, stop=("STOP",))
    sent = [cut.add([t]) for t in ids] + [cut.add([], final=True)]
    assert "".join(sent) == tokenizer.decode(ids).split("STOP")[0]


@pytest.mark.parametrize("case", ["missing template", "bad template", "port in use", "max-len", "replicas"])
def test_serve_refuses_bad_options_before_serving(capsys, tmp_path, case):
    from jaxmtp.cli import main

    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    argv, said = {"missing template": (["--chat-template", str(tmp_path / "none.jinja")], "No such file"),
                  "bad template": (["--chat-template", str(tmp_path / "bad.jinja")], "not a valid Jinja template"),
                  "port in use": (["--port", str(taken.getsockname()[1])], "cannot listen there"),
                  "max-len": (["--port", "0", "--max-len", "5000"], "max_position_embeddings (1024)"),
                  "replicas": (["--max-batch", "6", "--replicas", "4"], "--max-batch 6 does not divide into 4")}[case]
    with taken, pytest.raises(SystemExit) as exit_info:
        main(["serve", "demo", "--quiet", *argv])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err

"""The ASGI app: OpenAI's completions and chat completions over a `jaxmtp.engine.Engine`.

Each request is checked, turned into token ids and an engine `Request`, and submitted; the engine
calls back on its own thread with the request's events, which are handed to the request's
coroutine through the event loop (`Job`). A response streams them as server-sent events or
collects them into one body. A client that goes away cancels its request, so that its slot is
free at the engine's next step. /health and /v1/models never touch the engine; /metrics reads its
snapshot off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxmtp import chat
from jaxmtp.engine.requests import Event, NotAdmitting, QueueFull, Request
from jaxmtp.errors import ConfigError, InputError
from jaxmtp.serve import errors
from jaxmtp.serve.errors import ApiError
from jaxmtp.serve.metrics import CONTENT_TYPE, Metrics
from jaxmtp.serve.protocol import ChatRequest, CompletionRequest, Sampling
from jaxmtp.serve.text import IncrementalText

# After the engine has stopped, how long the open responses get to send their last events.
FLUSH_SECONDS = 5.0
# The engine Request fields whose name an engine's InputError message starts with.
REQUEST_FIELDS = {f.name for f in dataclasses.fields(Request)}


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets. max_tokens: at most this many new tokens, and
    no more than the prompt leaves of the engine's max_len."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it may write (jaxmtp.chat.render)."""

    template: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict]) -> str:
        return chat.render(self.template, messages, bos_token=self.bos_token, eos_token=self.eos_token)


class Job:
    """One submitted request: its events, handed from the engine's thread to the event loop, and
    its latencies observed as they arrive."""

    def __init__(self, service: "Service", arrived: float):
        self.service = service
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.timing = service.metrics.timing(arrived)
        self.handle = None
        self.finished = False

    def on_event(self, event: Event):
        """Called on the engine's thread."""
        self.timing.observe(event)
        with contextlib.suppress(RuntimeError):  # the loop has closed: the server is gone, and nobody reads
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self) -> Event:
        event = await self.queue.get()
        self.finished = event.finish_reason is not None
        return event

    def close(self):
        """The response is over: the request, unless it has ended, ends at the engine's next step."""
        if not self.finished and self.handle is not None:
            self.handle.cancel()
        self.service.open.discard(self)


@dataclasses.dataclass
class Reply:
    """What a response is built from: the request's id, kind and settings."""

    id: str
    kind: str  # "text" (/v1/completions) or "chat"
    model: str
    prompt_tokens: int
    text: IncrementalText
    logprobs: bool
    tokenizer: object
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class Service:
    """The app's state: the engine, the model's name and chat template, the defaults, the metrics
    and the requests in flight; and the drain that ends it all."""

    def __init__(self, engine, *, model_name: str, chat_template: ChatTemplate | None, defaults: Defaults,
                 shutdown_timeout: float):
        self.engine, self.model_name, self.template, self.defaults = engine, model_name, chat_template, defaults
        self.shutdown_timeout = shutdown_timeout
        self.metrics = Metrics(engine)
        self.created = int(time.time())
        self.open: set[Job] = set()
        self.draining = False
        self._drain: asyncio.Task | None = None
        self._stop_lock = threading.Lock()
        self._engine_stopping = False

    # ----- checks shared by both endpoints -----

    def check(self, body: Sampling):
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="shutting_down")
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model: {body.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if body.n not in (None, 1):
            raise ApiError(400, f"n: {body.n} choices asked; this server returns one choice per request", param="n")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: applies to streamed responses only (stream: true)",
                           param="stream_options")
        if body.stop and self.engine.tokenizer is None:
            raise ApiError(400, "stop: stop strings need the model's tokenizer, and this model has none (stop at "
                                "token ids with stop_token_ids)", param="stop")

    def max_tokens(self, given: int | None, field: str, prompt_len: int, prompt_field: str) -> int:
        """The request's max_tokens: as given (refused if the prompt plus it exceed max_len), else
        the default within what the prompt leaves."""
        max_len = self.engine.max_len
        room = max_len - prompt_len
        if room < 1:
            raise ApiError(400, f"{prompt_field}: {prompt_len} prompt tokens leave no room for a completion within "
                                f"this server's max_len of {max_len} tokens", param=prompt_field,
                           code="context_length_exceeded")
        if given is None:
            return min(self.defaults.max_tokens, room)
        if given > room:
            raise ApiError(400, f"{field}: {prompt_len} prompt tokens plus {given} new tokens exceed this server's "
                                f"max_len of {max_len} tokens ({room} new tokens at most for this prompt)",
                           param=field, code="context_length_exceeded")
        return given

    def request(self, body: Sampling, prompt: list[int], max_tokens: int, logprobs: bool) -> Request:
        d = self.defaults
        pick = (lambda value, default: default if value is None else value)
        return Request(prompt=tuple(prompt), max_tokens=max_tokens, temperature=pick(body.temperature, d.temperature),
                       top_p=pick(body.top_p, d.top_p), top_k=pick(body.top_k, d.top_k), seed=body.seed,
                       stop_token_ids=body.stop_token_ids or (), stop=body.stop or (), logprobs=logprobs,
                       ignore_eos=body.ignore_eos)

    def submit(self, request: Request, arrived: float, fields: dict[str, str]) -> Job:
        """Hands the request to the engine -> its Job. fields: the API's name of an engine Request
        field where it differs (an engine refusal names the Request's field)."""
        job = Job(self, arrived)
        try:
            job.handle = self.engine.submit(request, job.on_event)
        except QueueFull as e:
            raise ApiError(429, f"the server is at capacity: {e}", code="queue_full",
                           headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))}) from None
        except NotAdmitting as e:
            raise ApiError(503, f"the server is shutting down: {e}", code="shutting_down") from None
        except InputError as e:
            raise _refusal(str(e), fields) from None
        self.open.add(job)
        return job

    # ----- the end -----

    async def drain(self):
        """Stops taking requests (503), lets the running ones finish for up to shutdown_timeout
        seconds, cancels the rest (their responses end as cancelled), and gives the open responses
        FLUSH_SECONDS to send their last events. Once, however often called."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drained())
        await asyncio.shield(self._drain)

    async def _drained(self):
        self.draining = True
        self.engine.stop_admitting()
        await _in_thread(self.stop_engine)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FLUSH_SECONDS
        while self.open and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def stop_engine(self):
        """engine.shutdown(shutdown_timeout), once."""
        with self._stop_lock:
            if self._engine_stopping:
                return
            self._engine_stopping = True
        self.engine.shutdown(timeout=self.shutdown_timeout)


async def _in_thread(fn: Callable[[], None]):
    """Runs fn on a daemon thread of its own and waits for it, so that a forced exit does not
    wait for it as it would for the loop's executor."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run():
        try:
            fn()
        except BaseException as e:  # handed to the waiting coroutine
            loop.call_soon_threadsafe(_settle, done, e)
        else:
            loop.call_soon_threadsafe(_settle, done, None)

    threading.Thread(target=run, name="jaxmtp-serve-drain", daemon=True).start()
    await done


def _settle(future: asyncio.Future, error: BaseException | None):
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _refusal(message: str, fields: dict[str, str]) -> ApiError:
    """An engine InputError (its message starts with the Request field at fault) as a 400."""
    found = re.match(r"[a-z_]+", message)
    field = found.group(0) if found else None
    param = fields.get(field, field) if field in REQUEST_FIELDS else None
    return ApiError(400, message, param=param)


# ----- responses -----


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _usage(reply: Reply, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": reply.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(reply: Reply, token: int) -> str:
    return reply.tokenizer.decode([token]) if reply.tokenizer is not None else ""


def _logprobs(reply: Reply, tokens, logprobs) -> dict | None:
    """The tokens' log-probabilities in the endpoint's shape (none but the chosen token's)."""
    if not reply.logprobs:
        return None
    values = list(logprobs or ())
    if reply.kind == "chat":
        return {"content": [{"token": _token_text(reply, t), "logprob": p, "bytes": None, "top_logprobs": []}
                            for t, p in zip(tokens, values)]}
    return {"tokens": [_token_text(reply, t) for t in tokens], "token_logprobs": values, "top_logprobs": None,
            "text_offset": None}


def _head(reply: Reply, chunk: bool) -> dict:
    kind = "text_completion" if reply.kind == "text" else ("chat.completion.chunk" if chunk else "chat.completion")
    return {"id": reply.id, "object": kind, "created": reply.created, "model": reply.model}


def _choice(reply: Reply, text: str, tokens, logprobs, finish: str | None, *, chunk: bool, first: bool = False) -> dict:
    if reply.kind == "text":
        out = {"index": 0, "text": text}
    elif chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        out = {"index": 0, "delta": delta}
    else:
        out = {"index": 0, "message": {"role": "assistant", "content": text}}
    out.update({"finish_reason": finish, "logprobs": _logprobs(reply, tokens, logprobs), "token_ids": list(tokens)})
    return out


async def _disconnected(receive):
    """Returns when the client has gone (ASGI's http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _whole(reply: Reply, job: Job, http: HttpRequest) -> Response:
    """The events collected into one response; a client that goes away first cancels the request."""
    collect = asyncio.ensure_future(_collect(job))
    gone = asyncio.ensure_future(_disconnected(http.receive))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        answered = collect.done()
    finally:
        gone.cancel()
        collect.cancel()
        job.close()
    if not answered:
        return Response(status_code=499)  # nobody reads it
    tokens, logprobs, final = collect.result()
    if final.finish_reason == "error":
        raise ApiError(500, f"the request failed in the engine: {final.error}", code="engine_error")
    text = reply.text.add(tokens, final=True)
    body = {**_head(reply, chunk=False),
            "choices": [_choice(reply, text, tokens, logprobs if reply.logprobs else None, final.finish_reason,
                                chunk=False)],
            "usage": _usage(reply, len(tokens), final.cached_tokens)}
    return JSONResponse(body)


async def _collect(job: Job) -> tuple[list[int], list[float], Event]:
    tokens, logprobs = [], []
    while True:
        event = await job.next()
        tokens.extend(event.tokens)
        logprobs.extend(event.logprobs or ())
        if event.finish_reason is not None:
            return tokens, logprobs, event


async def _chunks(reply: Reply, job: Job, include_usage: bool) -> AsyncIterator[bytes]:
    """The events as server-sent events: a chunk per event that brings text, tokens or the end;
    with include_usage, a last chunk with the usage; then [DONE]. A failure in the engine is an
    error event. Closing the stream early (the client went away) cancels the request."""
    extra = {"usage": None} if include_usage else {}
    try:
        if reply.kind == "chat":
            yield _sse({**_head(reply, chunk=True), "choices": [_choice(reply, "", (), None, None, chunk=True,
                                                                        first=True)], **extra})
        count = 0
        while True:
            event = await job.next()
            if event.finish_reason == "error":
                yield _sse(errors.body(500, f"the request failed in the engine: {event.error}", code="engine_error"))
                break
            final = event.finish_reason is not None
            text = reply.text.add(event.tokens, final=final)
            count += len(event.tokens)
            if text or event.tokens or final:
                yield _sse({**_head(reply, chunk=True),
                            "choices": [_choice(reply, text, event.tokens, event.logprobs, event.finish_reason,
                                                chunk=True)], **extra})
            if final:
                if include_usage:
                    yield _sse({**_head(reply, chunk=True), "choices": [],
                                "usage": _usage(reply, count, event.cached_tokens)})
                break
        yield _sse("[DONE]")
    finally:
        job.close()


class EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source (which cancels the request), as soon
    as the client disconnects, whichever ASGI version the server speaks."""

    def __init__(self, chunks: AsyncIterator[bytes], job: Job):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stream.cancel()
            gone.cancel()
            results = await asyncio.gather(stream, gone, return_exceptions=True)
            await self.body_iterator.aclose()
            self.job.close()  # also where the stream was cancelled before it began
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):  # OSError: the client went away
            raise results[0]


# ----- the app -----


def create_app(engine, *, model_name: str, chat_template: ChatTemplate | None = None,
               defaults: Defaults = Defaults(), shutdown_timeout: float = 30.0) -> FastAPI:
    """The OpenAI-compatible app over a started engine (see docs/serving.md). The app owns the
    engine from here on: it shuts it down (`Service.drain`) when the server stops.

    model_name: the name /v1/models lists and responses carry. chat_template: what
    /v1/chat/completions renders messages with (None: it refuses them). defaults: the sampling
    values of a request that leaves them out. shutdown_timeout: seconds that running requests get
    to finish once the server stops."""
    service = Service(engine, model_name=model_name, chat_template=chat_template, defaults=defaults,
                      shutdown_timeout=shutdown_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await service.drain()

    app = FastAPI(title="jaxmtp", lifespan=lifespan)
    app.state.service = service
    errors.install(app)

    @app.get("/health")
    async def health():
        if service.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if engine.failed is not None:  # its thread ended on an error: nothing more is decoded
            return JSONResponse({"status": "failed", "error": engine.failed}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "jaxmtp", "max_model_len": engine.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(await asyncio.to_thread(service.metrics.render), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        arrived = time.perf_counter()
        service.check(body)
        if body.echo:
            raise ApiError(400, "echo: not supported; a response holds the completion only", param="echo")
        if body.logprobs:
            raise ApiError(400, f"logprobs: {body.logprobs} alternatives per token asked; only the chosen token's "
                                "log-probability is available (logprobs: 0)", param="logprobs")
        prompt = _encode(service, body.prompt)
        max_tokens = service.max_tokens(body.max_tokens, "max_tokens", len(prompt), "prompt")
        logprobs = body.logprobs is not None
        job = service.submit(service.request(body, prompt, max_tokens, logprobs), arrived, {})
        return await _respond(job, http, body, Reply(
            f"cmpl-{uuid.uuid4().hex}", "text", service.model_name, len(prompt),
            IncrementalText(engine.tokenizer, body.stop or ()), logprobs, engine.tokenizer))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        arrived = time.perf_counter()
        service.check(body)
        if body.top_logprobs:
            raise ApiError(400, f"top_logprobs: {body.top_logprobs} alternatives per token asked; only the chosen "
                                "token's log-probability is available (top_logprobs: 0)", param="top_logprobs")
        field, given = "max_tokens", body.max_tokens
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None:
                raise ApiError(400, "max_tokens: give max_tokens or max_completion_tokens, not both",
                               param="max_tokens")
            field, given = "max_completion_tokens", body.max_completion_tokens
        prompt = _chat_prompt(service, body)
        max_tokens = service.max_tokens(given, field, len(prompt), "messages")
        job = service.submit(service.request(body, prompt, max_tokens, body.logprobs), arrived,
                             {"prompt": "messages", "max_tokens": field})
        return await _respond(job, http, body, Reply(
            f"chatcmpl-{uuid.uuid4().hex}", "chat", service.model_name, len(prompt),
            IncrementalText(engine.tokenizer, body.stop or ()), body.logprobs, engine.tokenizer))

    return app


async def _respond(job: Job, http: HttpRequest, body: Sampling, reply: Reply) -> Response:
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(_chunks(reply, job, include_usage), job)
    return await _whole(reply, job, http)


def _encode(service: Service, prompt: str | list[int]) -> list[int]:
    """A completion's prompt as token ids (text through the model's tokenizer)."""
    if isinstance(prompt, list):
        return prompt
    tokenizer = service.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, "prompt: this model has no tokenizer (tokenizer.json) to encode text with; send token ids",
                       param="prompt")
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ApiError(400, "prompt: the text encodes to no tokens", param="prompt")
    return ids


def _chat_prompt(service: Service, body: ChatRequest) -> list[int]:
    """The messages rendered with the chat template and encoded (the template writes the special
    tokens, so the tokenizer adds none)."""
    if service.template is None:
        raise ApiError(400, "messages: this model has no chat template (no chat_template in its "
                            "tokenizer_config.json); start the server with --chat-template FILE",
                       param="messages", code="no_chat_template")
    tokenizer = service.engine.tokenizer
    if tokenizer is None:
        raise ApiError(400, "messages: this model has no tokenizer (tokenizer.json) to encode the conversation with",
                       param="messages")
    try:
        text = service.template.render([m.for_template() for m in body.messages])
    except ConfigError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise ApiError(400, "messages: the conversation renders to no tokens", param="messages")
    return ids

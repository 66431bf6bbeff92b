"""What a caller hands the serving engine and what it hears back: `Request`, `Event`, `Handle`.

The engine (`jaxmtp.engine.Engine`) runs on one thread of its own; `submit` may be called from any
thread and returns at once. Each request's events arrive, in order, through the callback given to
`submit`, called on the engine's thread (an asyncio server forwards them with
`loop.call_soon_threadsafe`). Every accepted request ends with exactly one event whose
`finish_reason` is set.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from jaxmtp.errors import InputError


class QueueFull(InputError):
    """The engine's queue of waiting requests is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class NotAdmitting(InputError):
    """The engine is shutting down (or stopped) and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion. prompt: token ids. max_tokens: new tokens at most (the prompt plus these
    must fit the engine's max_len). temperature 0 is greedy (top_p / top_k then unused); top_k 0
    and top_p 1 are off. seed: of this request's sampling (None: the engine picks one).
    stop_token_ids: token sequences that end the request after their last token (checked on
    device); eos ids end it too unless ignore_eos. stop: strings that end it (needs the engine's
    tokenizer; the text is cut before the string). logprobs: each new token's log-probability
    under the distribution it was chosen from (the model's softmax when greedy)."""

    prompt: tuple[int, ...]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False


@dataclasses.dataclass(frozen=True)
class Event:
    """New tokens of one request (possibly none) and, on its last event, why it ended.

    tokens: ids committed since the last event (cut before a stop string's end where one matched:
    the token that completes it is kept, as the text is cut by the caller). logprobs: theirs, or
    None. finish_reason: None while it runs; then "stop" (EOS, a stop sequence or string),
    "length" (max_tokens), "cancelled" (cancel or shutdown) or "error" (error says what).
    prompt_tokens / completion_tokens: the counts so far. cached_tokens: prompt tokens whose cache
    entries came from the prefix store instead of a prefill."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Handle:
    """A submitted request: `cancel()` ends it at the engine's next step (its slot is free then)
    with a "cancelled" event, unless it has ended already."""

    def __init__(self, request: Request, on_event: Callable[[Event], None], request_id: int):
        self.request, self.on_event, self.id = request, on_event, request_id
        self._cancelled = threading.Event()

    def cancel(self):
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

"""The host side of streaming: each row's tokens as the loop commits them, and stop strings.

The loop runs in chunks of steps (`jaxmtp.decoding.advance` with a step budget); after each chunk
the host reads the committed tokens and hands them to a `Receiver`, which may end rows: when a stop
string appears in a row's decoded text (which only the host can see). The state stays on the
device between chunks; nothing but the token ids crosses over.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import numpy as np

from jaxmtp.errors import InputError


class Receiver:
    """Each row's committed tokens, as they arrive.

    rows: the real rows (batch padding rows beyond them are ignored). stop: strings that end a row
    once its decoded text contains one (needs `tokenizer`, anything with `decode(ids) -> str`); the
    row keeps the tokens up to the one that completes the string.
    """

    def __init__(self, rows: int, tokenizer=None, stop: Sequence[str] = ()):
        if stop and tokenizer is None:
            raise InputError("stop strings need a tokenizer to decode the tokens (tokenizer=...)")
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.stopped = [False] * rows
        self._tokenizer, self._stop = tokenizer, tuple(stop)

    def receive(self, seq: np.ndarray, lengths: np.ndarray, count: np.ndarray) -> list[list[int]]:
        """seq [B, W] (tokens by position), lengths [B] (prompt lengths), count [B] (new tokens so
        far) -> each real row's tokens committed since the last call (cut at a stop string)."""
        out = []
        for row, tokens in enumerate(self.tokens):
            new = [] if self.stopped[row] else seq[row, lengths[row] + len(tokens):lengths[row] + count[row]].tolist()
            end = self._stop_at(row, new)
            if end is not None:
                new, self.stopped[row] = new[:end], True
            tokens.extend(new)
            out.append(new)
        return out

    def halted(self, batch: int) -> np.ndarray:
        """[batch] bool: the rows a stop string ended (batch padding rows are not)."""
        return np.pad(np.array(self.stopped, bool), (0, batch - len(self.stopped)))

    def _stop_at(self, row: int, tokens: list[int]) -> int | None:
        """How many of a row's new tokens reach the end of its first stop string, or None."""
        if not self._stop or not any(s in self._tokenizer.decode(self.tokens[row] + tokens) for s in self._stop):
            return None
        for end in range(1, len(tokens) + 1):
            if any(s in self._tokenizer.decode(self.tokens[row] + tokens[:end]) for s in self._stop):
                return end
        return None

    def text(self, row: int = 0, final: bool = True) -> str:
        """A row's decoded text, cut before its stop string. With final=False (while it streams),
        also without what may still change: a trailing partial UTF-8 character ("\\ufffd") and a
        tail that could be the start of a stop string."""
        if self._tokenizer is None:
            raise InputError("text: needs the tokenizer the tokens were generated with (tokenizer=...)")
        return visible(self._tokenizer.decode(self.tokens[row]), self._stop, final)


def visible(text: str, stop: Sequence[str], final: bool = True) -> str:
    """Decoded text cut before its first stop string; with final=False (while it streams), also
    without what may still change: a trailing partial UTF-8 character ("\\ufffd") and a tail that
    could be the start of a stop string."""
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        return text[:min(cuts)]
    if final:
        return text
    text = text.rstrip("\ufffd")
    hold = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[:len(text) - hold]


def echo(stream, prompt: list[int], tokenizer=None, file=None) -> tuple[float, float | None]:
    """Runs `stream` (a `jaxmtp.TokenStream` of `prompt`), writing the prompt and then each chunk's
    text to `file` (stdout) as it is committed: the text that can no longer change (a stop string's
    start is held back), or the token ids without a tokenizer.

    Returns (seconds the run took, seconds to the first new token or None)."""
    file = file or sys.stdout
    start, first, shown = time.perf_counter(), None, 0
    print(tokenizer.decode(prompt, skip_special_tokens=False) if tokenizer else f"{prompt} ->", end="", file=file,
          flush=True)
    for tokens in stream:
        if tokens and first is None:
            first = time.perf_counter() - start
        if tokenizer is None:
            print("".join(f" {t}" for t in tokens), end="", file=file, flush=True)
        else:
            text = stream.text(final=False)
            print(text[shown:], end="", file=file, flush=True)
            shown = len(text)
    seconds = time.perf_counter() - start
    print(stream.text()[shown:] if tokenizer else "", end="\n\n", file=file, flush=True)
    return seconds, first

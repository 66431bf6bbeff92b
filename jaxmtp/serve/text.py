"""A completion's text as its tokens arrive: what can be sent now, and the final text.

Text is sent only once it can no longer change: a trailing partial UTF-8 character (decoded as
"\\ufffd") waits for the token that completes it, and a tail that could be the start of a stop
string waits until the string is ruled out. The final text is cut before the first stop string;
the engine keeps the token that completes it, so the cut is made here, on the text.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxmtp import streaming


class IncrementalText:
    """tokenizer: anything with decode(ids) -> str, or None (the text is then always empty: the
    completion is only its token ids). stop: the request's stop strings."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer, self._stop = tokenizer, tuple(stop)
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already handed out

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """Takes the next tokens -> the text to send now (all that is left when final)."""
        self.tokens.extend(tokens)
        text = self.text(final)
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta

    def text(self, final: bool = True) -> str:
        """The text so far, cut before a stop string; with final=False, without what may still change."""
        if self._tokenizer is None:
            return ""
        return streaming.visible(self._tokenizer.decode(self.tokens), self._stop, final)

"""The request bodies of /v1/completions and /v1/chat/completions, as OpenAI's API defines them,
with what this server refuses.

Every model refuses fields it does not know (a misspelt field is an error, not ignored) and values
of the wrong JSON type (strict: "0.5" is no number). Fields OpenAI has that this server cannot
honour are refused where given with a value that would need them (n > 1, echo, top log-probability
alternatives). Extensions: top_k, stop_token_ids, ignore_eos.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

INT64 = 2**63


def _prompt(value) -> str | list[int]:
    """A prompt: text, token ids, or a list of one of those (OpenAI's batch form, of one)."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise ValueError(f"a batch of {len(value)} prompts; this server takes one prompt per request "
                             "(send them as separate requests)")
        value = value[0]
    if isinstance(value, str) or (isinstance(value, list) and all(type(t) is int for t in value)):
        if not value:
            raise ValueError("empty; a prompt needs at least one token")
        return value
    raise ValueError("expected a string, a list of token ids, or a list holding one of those")


def _stop(value) -> tuple[str, ...]:
    """Stop strings: one string or a list of them, none empty."""
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError("expected a string or a list of strings")
    if not all(strings):
        raise ValueError("an empty stop string would end every completion at once")
    return tuple(strings)


def _stop_token_ids(value) -> tuple[tuple[int, ...], ...]:
    """Token sequences: a list of non-empty lists of token ids."""
    if not isinstance(value, list) or not all(isinstance(s, list) and all(type(t) is int for t in s) for s in value):
        raise ValueError("expected a list of token-id lists, e.g. [[13], [198, 198]]")
    if not all(value):
        raise ValueError("an empty stop sequence")
    return tuple(tuple(s) for s in value)


Prompt = Annotated[str | list[int], PlainValidator(
    _prompt, json_schema_input_type=str | list[int] | list[str] | list[list[int]])]
Stop = Annotated[tuple[str, ...], PlainValidator(_stop, json_schema_input_type=str | list[str])]
StopTokenIds = Annotated[tuple[tuple[int, ...], ...], PlainValidator(_stop_token_ids,
                                                                     json_schema_input_type=list[list[int]])]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The fields both endpoints share. Left out (or null), a field takes the server's default."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="extension: sample from the k likeliest tokens; 0 = all")
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = Field(
        None, description="extension: token sequences that end the completion (after their last token)")
    ignore_eos: bool = Field(False, description="extension: do not stop at the model's EOS ids")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    user: str | None = None  # accepted and ignored


class CompletionRequest(Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it: {"role", "content"} (and "name" if given)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        out = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

"""`GenerationConfig`: what `generate` takes besides the model and the prompts; a checkpoint's own
`generation_config.json` read into one."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

from jaxmtp.errors import ArgumentTypeError, ConfigError


# Prompt positions the prefill runs at once by default; longer prompts are prefilled chunk by chunk.
DEFAULT_PREFILL_CHUNK = 512

FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """max_new_tokens: per prompt, at most. temperature: 0 = greedy (top_k / top_p then unused).
    top_k: 0 = off (as is any value >= the vocabulary). top_p: 1.0 = off. speculative_k: drafts
    per round from the MTP module (0 = plain decoding, up to 8), or "auto" (chosen as it goes).
    eos_token_id: an id or a list of ids; a row stops right after emitting any of them.
    stop_token_ids: token sequences; a row stops right after the first complete one among its new
    tokens (checked on device). stop: strings; a row stops at the token whose decoded text
    completes one (needs a tokenizer; the text is cut before it). seed: of the sampling.
    return_logprobs: also return each emitted token's log-probability. prefill_chunk: prompt
    positions prefilled at once (a multiple of 16); a longer prompt is prefilled chunk by chunk,
    which bounds the prefill's memory by the chunk instead of the prompt."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    speculative_k: int | str = 0
    eos_token_id: int | Sequence[int] | None = None
    stop_token_ids: Sequence[Sequence[int]] = ()
    stop: Sequence[str] = ()
    seed: int = 0
    return_logprobs: bool = False
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    def replace(self, **changes) -> "GenerationConfig":
        """A copy with these fields changed; an unknown name is a TypeError naming it."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ArgumentTypeError(f"unknown generation option {', '.join(unknown)}; the options are {', '.join(sorted(fields))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_pretrained(cls, directory: str, **overrides) -> "GenerationConfig":
        """The settings of a checkpoint directory's generation_config.json (eos_token_id, and with
        do_sample: true, temperature (1 if unset), top_k, top_p; max_new_tokens), the defaults where it has none
        or there is no file; `overrides` win over both. As transformers reads it, a file without
        do_sample: true means greedy decoding."""
        return cls().replace(**{**read(directory), **overrides})


def read(directory: str) -> dict:
    """The GenerationConfig fields that `directory`/generation_config.json sets ({} without one)."""
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    out = {}
    if raw.get("eos_token_id") is not None:
        out["eos_token_id"] = raw["eos_token_id"]
    if raw.get("max_new_tokens") is not None:
        out["max_new_tokens"] = raw["max_new_tokens"]
    sample = raw.get("do_sample", False)
    if not isinstance(sample, bool):
        raise ConfigError(f"{path}: do_sample: expected true or false, found {sample!r}")
    if sample:
        out.update({name: raw[name] for name in ("temperature", "top_k", "top_p") if raw.get(name) is not None})
        out.setdefault("temperature", 1.0)
    for name, value in out.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, list)):
            raise ConfigError(f"{path}: {name}: expected a number{' or a list of ids' if 'eos' in name else ''}, "
                              f"found {value!r}")
    return out

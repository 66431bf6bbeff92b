"""`jaxmtp.generate` and `jaxmtp.generate_stream` for a DeepSeek-V4 model: a `GenerationConfig`'s
fields on `speculative.decode` (its rounds in compiled loops), with `GenerationStats` counted from its
rounds. speculative_k="auto" chooses among k = 0..auto_max_k from `speculative.round_costs`, kept on
disk like the V3 loop's calibration."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxmtp import streaming
from jaxmtp.errors import InputError
from jaxmtp.generation import GenerationOutput, TokenStream, _check, auto_max_k
from jaxmtp.generation_config import GenerationConfig
from jaxmtp.models.deepseek_v4 import speculative
from jaxmtp.models.deepseek_v4.model import V4Model
from jaxmtp.stats import GenerationStats


def rounds(model: V4Model, prompts, g: GenerationConfig, tokenizer) -> Iterator[list[list[int]]]:
    """Each row's new tokens after the prefill and after each round; returns the `GenerationOutput`.
    A prompt shorter than g.prefill_chunk is prefilled in one pass, a longer one in its chunks."""
    if g.speculative_k not in (0, "auto") and not model.config.has_mtp and model.mtp_note:
        raise InputError(f"speculative_k: this model has no MTP block to draft with: {model.mtp_note}")
    prompts, _ = _check(model, prompts, g)  # refuses what jaxmtp.generate refuses, naming it
    has_mtp, auto = model.config.has_mtp, g.speculative_k == "auto"
    most = (auto_max_k(model) if has_mtp else 0) if auto else g.speculative_k
    longest = max(len(p) for p in prompts)
    chunk = g.prefill_chunk if longest > g.prefill_chunk else None
    width, cache_len = speculative.sizes(longest, g.max_new_tokens, most, chunk)  # decode's own sizes
    options = dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, seed=g.seed, cache_len=cache_len,
                   prefill_chunk=chunk, eos_token_id=g.eos_token_id, stop_token_ids=g.stop_token_ids, stop=g.stop,
                   tokenizer=tokenizer)
    costs = None
    if auto and most:
        costs = speculative.round_costs(model, len(prompts), cache_len, most)
        options.update(k_max=most, costs=costs)
    k = "auto" if auto and most else (0 if auto else most)
    n = len(prompts)
    tokens, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    ran, drafted, accepted = np.zeros(n, int), np.zeros(n, int), np.zeros(n, int)
    accepted_at, rounds_at = np.zeros((n, most), int), np.zeros((n, most + 1), int)
    for new, new_logprobs, chosen, taken in speculative.decode(model, prompts, g.max_new_tokens, k, **options):
        for i in range(n):
            tokens[i] += new[i]
            logprobs[i] += new_logprobs[i]
            if chosen is not None and new[i]:  # a live row commits at least one token a round
                ran[i] += 1
                drafted[i] += chosen
                accepted[i] += taken[i]
                accepted_at[i, :taken[i]] += 1
                rounds_at[i, chosen] += 1
        yield new
    chunks = -(-width // chunk) if chunk else 1
    stats = GenerationStats.of(ran, drafted, accepted, accepted_at, rounds_at, chunks + int(ran.max()), costs)
    return GenerationOutput(tokens, stats, logprobs if g.return_logprobs else None)


def generate(model: V4Model, prompts, g: GenerationConfig, tokenizer) -> GenerationOutput:
    """`jaxmtp.generate` of a V4 model."""
    steps = rounds(model, prompts, g, tokenizer)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


class V4TokenStream(TokenStream):
    """`jaxmtp.generate_stream` of a V4 model: yields one prompt's tokens round by round (a loop's
    rounds reach the host together, see speculative.decode); then
    `output` and `stats` hold the whole run's, and `text()` its decoded text."""

    def __init__(self, model: V4Model, prompt, g: GenerationConfig, tokenizer):
        _check(model, [prompt], g)  # before anything runs, as generate_stream checks
        self._model, self._prompt, self._g, self._tokenizer = model, prompt, g, tokenizer
        self.receiver = streaming.Receiver(1, tokenizer, g.stop)
        self.output = None

    def __iter__(self) -> Iterator[list[int]]:
        steps = rounds(self._model, [self._prompt], self._g, self._tokenizer)
        while True:
            try:
                (new,) = next(steps)
            except StopIteration as end:
                self.output = end.value
                return self.output.stats
            self.receiver.tokens[0].extend(new)
            yield new

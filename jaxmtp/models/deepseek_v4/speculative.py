"""Speculative decoding on DeepSeek-V4 with its MTP block, its rounds in a compiled loop.

A row's newest token t_n sits at position n, not yet fed to the model; its first draft d1 came from
the MTP block's slot n - 1 (streams of position n - 1 and the token t_n), and that slot's output
streams are kept to draft further. A round of k:
1. drafts d2..dk: slot n + j - 1 reads the block's own streams of the previous slot and d_j;
2. verifies [t_n, d1..dk] at positions n..n+k in one main forward: greedy accepts the longest run
   of drafts equal to the main model's argmax, sampling accepts d_j with probability
   min(1, p/q) (jaxmtp.speculative), and either adds one token of the main model's;
3. repairs the MTP cache at slots n..n+a with the main model's streams and the committed tokens,
   which also drafts the next round's d1.
Caches are stored by position (jaxmtp.models.deepseek_v4.attention), so the rejected drafts'
entries are rolled back by advancing n by a + 1 only. Plain decoding is the k = 0 round.
`run_rounds` runs rounds at one k in a while loop on the device, which ends rows at their limits
and stop sequences; the host reads a loop's rounds at once, so it waits on the device once a loop,
not once a round (benchmarks/v4_loop.py).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import calibration, checks
from jaxmtp.adaptive import AcceptanceCounts, best_k
from jaxmtp.decoding import ANY, AUTO_SEGMENT, NEVER, _finish
from jaxmtp.errors import InputError
from jaxmtp.generation import _fetch
from jaxmtp.models.deepseek_v4.model import V4Model
from jaxmtp.models.deepseek_v4.transformer import DeepseekV4
from jaxmtp.quant import QuantizedWeight
from jaxmtp.sampling import SamplingMode, SamplingParams, choose, log_probabilities, split
from jaxmtp.speculative import verify_greedy, verify_sampled

# Rounds per call of the compiled loop at a fixed k (auto's calls run AUTO_SEGMENT, the rounds
# between its choices, in loops of the same length): one call's tokens reach the host, and a
# stream, together.
SEGMENT_ROUNDS = 16
STOP_TABLE = (4, 4)  # the smallest stop table (sequences, tokens), see stop_table


@flax.struct.dataclass
class RoundState:
    """Between rounds. caches, mtp_cache; n [B]: the position of t_n; token [B]: t_n; draft [B]: d1;
    draft_probs [B, V] (sampling; else None): the distribution d1 was drawn from; recycled
    [B, 1, N, D]: the MTP streams d1 came from; key: the next round's key."""

    caches: tuple
    mtp_cache: object
    n: jax.Array
    token: jax.Array
    draft: jax.Array
    draft_probs: jax.Array | None
    recycled: jax.Array
    key: jax.Array


def _module(config, dtype, params):
    model = DeepseekV4(config, dtype)
    return lambda *args, method=None: model.apply({"params": params}, *args, method=method)


def _at(values, index):
    """values [B, T, ...], index [B] -> values[b, index[b]] [B, ...]."""
    return jnp.take_along_axis(values, index.reshape((-1, 1) + (1,) * (values.ndim - 2)), axis=1)[:, 0]


@partial(jax.jit, static_argnums=(0, 1))
def prefill_chunk(config, dtype, params, chunk, at, lengths, caches, window, last):
    """The main model over prompt positions at..at+C-1 of every row (chunk [B, C], rows right-padded
    to lengths [B]). Keeps what the rest of the prefill needs: window [B, S, N, D], the streams of
    each row's last S = window.shape[1] prompt positions (from max(lengths - S, 0)), and last [B, V],
    the logits at each row's last prompt position. -> (caches, window, last)."""
    apply = _module(config, dtype, params)
    b, width = chunk.shape
    count = jnp.clip(lengths - at, 0, width)
    logits, _, streams, caches = apply(chunk, jnp.full((b,), at, jnp.int32), count, caches)
    wanted = jnp.maximum(lengths - window.shape[1], 0)[:, None] + jnp.arange(window.shape[1])[None] - at
    here = (wanted >= 0) & (wanted < width)
    window = jnp.where(here[..., None, None], jnp.take_along_axis(
        streams, jnp.clip(wanted, 0, width - 1)[..., None, None], axis=1).astype(window.dtype), window)
    ends = lengths - 1 - at
    last = jnp.where(((ends >= 0) & (ends < width))[:, None], _at(logits, jnp.clip(ends, 0, width - 1)), last)
    return caches, window, last


@partial(jax.jit, static_argnums=(0, 1, 2))
def prefill_finish(config, dtype, mode: SamplingMode, params, sampling, key, prompt, lengths, window, last, mtp_cache):
    """Chooses t_n (at position lengths) from the last prompt logits, and runs the MTP block over
    the window of the prompt's last positions (it attends to the sliding window only), which drafts
    d1. -> (RoundState, the log-probability of t_n [B] under the distribution it was chosen from)."""
    apply = _module(config, dtype, params)
    b, width = prompt.shape
    span = window.shape[1]
    first_key, draft_key, key = split(key, 3)
    token, _ = choose(first_key, last, mode, sampling)
    logprob = jnp.take_along_axis(log_probabilities(last, mode, sampling), token[:, None], axis=-1)[:, 0]
    seq = jnp.concatenate([prompt, jnp.zeros((b, 1), jnp.int32)], axis=1).at[jnp.arange(b), lengths].set(token)
    start = jnp.maximum(lengths - span, 0)
    nexts = jnp.take_along_axis(seq, jnp.clip(start[:, None] + jnp.arange(span)[None] + 1, 0, width), axis=1)
    mtp_logits, mtp_streams, mtp_cache = apply(window, nexts, start, lengths - start, mtp_cache,
                                               method=DeepseekV4.mtp_step)
    end = lengths - start - 1
    draft, probs = choose(draft_key, _at(mtp_logits, end), mode, sampling)
    return RoundState(caches=(), mtp_cache=mtp_cache, n=lengths, token=token, draft=draft, draft_probs=probs,
                      recycled=_at(mtp_streams, end)[:, None], key=key), logprob


def prefill(model: V4Model, mode: SamplingMode, sampling, key, prompt, lengths, caches, mtp_cache,
            chunk: int | None = None) -> tuple[RoundState, jax.Array]:
    """The prompts [B, P] (right-padded to lengths [B]) in chunks of `chunk` positions (default: one
    pass; P must then be a multiple of it) -> (the first round's state, t_n's log-probability [B])."""
    c, dtype = model.config, model.dtype
    b, width = prompt.shape
    chunk = chunk or width
    span = min(c.sliding_window, width)
    window = jnp.zeros((b, span, c.hc_mult, c.hidden_size), dtype)
    last = jnp.zeros((b, c.vocab_size), jnp.float32)
    with model.mesh_context():
        window, last, prompt, lengths = model.place_rows((window, last, jnp.asarray(prompt), jnp.asarray(lengths)))
        for at in range(0, width, chunk):
            caches, window, last = prefill_chunk(c, dtype, model.params, prompt[:, at:at + chunk], at, lengths,
                                                 caches, window, last)
        state, logprob = prefill_finish(c, dtype, mode, model.params, sampling, key, prompt, lengths, window, last,
                                        mtp_cache)
    return state.replace(caches=caches), logprob


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def run_round(config, dtype, k: int, mode: SamplingMode, repair: bool, params, sampling, state: RoundState):
    """One round of k drafts (0: plain decoding) for every row. `repair` (implied at k > 0) runs the
    MTP block over the committed positions, so that a later round can draft; auto's rounds at k = 0
    do, plain decoding's do not.
    -> (state, committed [B, k + 1]: the first a + 1 of each row are its new tokens, their
    log-probabilities [B, k + 1] under the distribution each was verified against, accepted a [B])."""
    apply = _module(config, dtype, params)
    b = state.n.shape[0]
    one = jnp.ones(b, jnp.int32)
    keys = split(state.key, k + 3)
    n, mtp_cache = state.n, state.mtp_cache
    drafts, probs, streams = [state.draft], [state.draft_probs], state.recycled
    for j in range(1, k):
        logits, streams, mtp_cache = apply(streams, drafts[-1][:, None], n + j - 1, one, mtp_cache,
                                           method=DeepseekV4.mtp_step)
        draft, q = choose(keys[j], logits[:, 0], mode, sampling)
        drafts.append(draft)
        probs.append(q)
    drafts = jnp.stack(drafts, axis=1)[:, :k]  # [B, k]; k = 0 drafts nothing
    logits, _, main_streams, caches = apply(jnp.concatenate([state.token[:, None], drafts], axis=1), n,
                                            one * (k + 1), state.caches)
    if mode.greedy:
        accepted, after = verify_greedy(drafts, logits)
    elif k:
        accepted, after = verify_sampled(keys[k], drafts, jnp.stack(probs[:k], axis=1), logits, mode, sampling)
    else:
        accepted, after = jnp.zeros(b, jnp.int32), choose(keys[0], logits[:, 0], mode, sampling)[0]
    committed = jnp.concatenate([drafts, after[:, None]], axis=1).at[jnp.arange(b), accepted].set(after)
    logprobs = jnp.take_along_axis(log_probabilities(logits, mode, sampling), committed[..., None], axis=-1)[..., 0]
    draft, draft_probs, recycled = state.draft, state.draft_probs, state.recycled
    if k or repair:
        mtp_logits, mtp_streams, mtp_cache = apply(main_streams, committed, n, accepted + 1, mtp_cache,
                                                   method=DeepseekV4.mtp_step)
        draft, draft_probs = choose(keys[k + 1], _at(mtp_logits, accepted), mode, sampling)
        recycled = _at(mtp_streams, accepted)[:, None]
    state = RoundState(caches=caches, mtp_cache=mtp_cache, n=n + accepted + 1, token=after, draft=draft,
                       draft_probs=draft_probs, recycled=recycled, key=keys[k + 2])
    return state, committed, logprobs, accepted


@flax.struct.dataclass
class Ends:
    """What the compiled loop checks after each round, per row: seq [B, W], the row's tokens by
    position (those from position n - count + 1 on are generated; t_n at n); count [B], tokens
    generated; done [B]; limits [B], max new tokens; stops [N, L], stop sequences (EOS ids are
    sequences of one), right-aligned after ANY, unused rows NEVER (as jaxmtp.decoding's Inputs)."""

    seq: jax.Array
    count: jax.Array
    done: jax.Array
    limits: jax.Array
    stops: jax.Array


@flax.struct.dataclass
class Log:
    """A loop's rounds, for the host: committed [R, B, k + 1] and logprobs [R, B, k + 1] as
    run_round returns them, accepted [R, B]; ran []: the rounds that ran (the first `ran` of R)."""

    committed: jax.Array
    logprobs: jax.Array
    accepted: jax.Array
    ran: jax.Array


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnames=("state", "ends"))
def run_rounds(config, dtype, k: int, mode: SamplingMode, repair: bool, length: int, params, sampling,
               state: RoundState, ends: Ends, rounds):
    """Up to `rounds` (traced, at most `length`) rounds of run_round in one compiled loop, which
    stops early once every row is done: at its limit, or after a token that completes a stop
    sequence (stop strings are the host's to find; their rows decode on until the loop ends).
    Rows that are done keep decoding, as run_round's rows do; their tokens are not counted.
    -> (state, ends, Log of the rounds)."""
    b = state.n.shape[0]
    log = Log(committed=jnp.zeros((length, b, k + 1), jnp.int32), logprobs=jnp.zeros((length, b, k + 1), jnp.float32),
              accepted=jnp.zeros((length, b), jnp.int32), ran=jnp.int32(0))

    def body(carry):
        state, ends, log = carry
        n = state.n
        state, committed, logprobs, accepted = run_round(config, dtype, k, mode, repair, params, sampling, state)
        seq = ends.seq.at[jnp.arange(b)[:, None], n[:, None] + 1 + jnp.arange(k + 1)].set(committed, mode="drop")
        produced = jnp.where(ends.done, 0, accepted + 1)
        kept, stopped = _finish(seq, n, ends.count, committed, produced, ends.limits, ends.stops)
        ends = ends.replace(seq=seq, count=ends.count + kept, done=ends.done | stopped)
        i = log.ran
        log = Log(committed=log.committed.at[i].set(committed), logprobs=log.logprobs.at[i].set(logprobs),
                  accepted=log.accepted.at[i].set(accepted), ran=i + 1)
        return state, ends, log

    def running(carry):
        return (carry[2].ran < jnp.minimum(rounds, length)) & ~jnp.all(carry[1].done)

    with jax.named_scope("rounds"):
        return jax.lax.while_loop(running, body, (state, ends, log))


def stop_table(sequences: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Stop sequences as the loop's table [N, L], N and L powers of two (at least STOP_TABLE), so
    that calls with a few short sequences share one compiled loop."""
    rows = max(STOP_TABLE[0], 1 << max(len(sequences) - 1, 0).bit_length())
    width = max(STOP_TABLE[1], 1 << max(max(map(len, sequences), default=1) - 1, 0).bit_length())
    table = np.full((rows, width), NEVER, np.int32)
    for row, s in zip(table, sequences):
        row[:] = ANY
        row[width - len(s):] = s
    return table


@dataclasses.dataclass(frozen=True)
class Output:
    """tokens: the new tokens of each prompt; logprobs: their log-probabilities under the
    distribution each was chosen from (the model's softmax where greedy); rounds: (k, accepted
    drafts per row [B]) of every round."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    rounds: list[tuple[int, np.ndarray]]


def generate(model: V4Model, prompts, max_new_tokens: int, k: int | str = 0, **options) -> Output:
    """Decodes each prompt with k drafts per round; the options and the rules are `decode`'s."""
    tokens, logprobs, rounds = [[] for _ in prompts], [[] for _ in prompts], []
    for new, new_logprobs, chosen, accepted in decode(model, prompts, max_new_tokens, k, **options):
        for row, more in zip(tokens, new):
            row.extend(more)
        for row, more in zip(logprobs, new_logprobs):
            row.extend(more)
        if chosen is not None:
            rounds.append((chosen, accepted))
    return Output(tokens, logprobs, rounds)


def stream(model: V4Model, prompt, max_new_tokens: int, k: int | str = 0, **options):
    """One prompt's new tokens as they are committed: a list per round that commits any (the first
    from the prefill); `decode`'s options."""
    for new, _, _, _ in decode(model, [prompt], max_new_tokens, k, **options):
        if new[0]:
            yield new[0]


def decode(model: V4Model, prompts, max_new_tokens: int, k: int | str = 0, *, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int = 0, k_max: int = 3, costs=None,
           cache_len: int | None = None, headroom: int | None = None, prefill_chunk: int | None = None,
           eos_token_id=None, stop_token_ids=(), stop=(), tokenizer=None, segment_rounds: int = SEGMENT_ROUNDS):
    """Decodes each prompt with k drafts per round (0: plain; "auto": chosen every AUTO_SEGMENT
    rounds in 0..k_max from `costs` [k_max + 1], a round's cost in plain rounds, and the acceptance
    so far, as jaxmtp.adaptive does), greedily at temperature 0, else sampling from the
    temperature / top-k / top-p distribution. A row ends after max_new_tokens, or after the token
    that completes an eos_token_id (an id or a list), a sequence of stop_token_ids (a list of
    token-id lists) or a `stop` string in the row's decoded new text (needs `tokenizer`, anything
    with decode(ids) -> str); that token is kept, as jaxmtp.generate keeps it. Prompts are
    prefilled in chunks of `prefill_chunk` positions (default: one pass). cache_len (positions) and
    headroom (at least the most drafts + 1) size the caches; by default as this call needs, and
    calls with equal sizes share their compiled programs. The rounds run in compiled loops
    (run_rounds) of segment_rounds rounds at a fixed k; with auto, of AUTO_SEGMENT (or fewer where
    segment_rounds is smaller), the rounds between its choices.
    Yields, after the prefill and after each round: (each row's new tokens, their
    log-probabilities, the round's k or None for the prefill, its accepted drafts [B] or None)."""
    prompts = checks.prompts(prompts, model.config.vocab_size)
    checks.whole("max_new_tokens", max_new_tokens, minimum=1)
    auto = k == "auto"
    if auto:
        checks.whole("k_max", k_max, minimum=1)
        if costs is None or len(costs) != k_max + 1:
            raise InputError(f"costs: auto needs a round's cost at k = 0..{k_max} (round_costs), found {costs!r}")
    else:
        checks.whole("k", k, minimum=0)
    checks.whole("segment_rounds", segment_rounds, minimum=1)
    most = k_max if auto else k
    if most and not model.config.has_mtp:
        raise InputError("k: this model has no MTP block to draft with (num_nextn_predict_layers = 0)"
                         + (f": {model.mtp_note}" if model.mtp_note else ""))
    mode = SamplingMode.of(checks.real("temperature", temperature, 0.0), top_k, top_p)
    sampling = SamplingParams(temperature=jnp.float32(temperature or 1.0), top_k=jnp.int32(max(top_k, 1)),
                              top_p=jnp.float32(top_p))
    ends = _Ends(tuple((t,) for t in checks.eos_ids(eos_token_id, model.config.vocab_size))
                 + checks.stop_sequences(stop_token_ids, model.config.vocab_size), checks.stop_strings(stop), tokenizer)
    lengths = np.array([len(p) for p in prompts], np.int32)
    b = len(prompts)
    chunk = prefill_chunk and checks.whole("prefill_chunk", prefill_chunk, minimum=1)
    width, needed = sizes(int(lengths.max()), max_new_tokens, most, chunk)
    prompt = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, :len(p)] = p
    max_len = checks.whole("cache_len", cache_len, minimum=needed) if cache_len is not None else needed
    headroom = checks.whole("headroom", headroom, minimum=most + 1) if headroom is not None else most + 1
    c, dtype = model.config, model.dtype
    state, logprob = prefill(model, mode, sampling, jax.random.key(seed), prompt, lengths,
                             model.new_caches(b, max_len, headroom), model.new_mtp_cache(b, max_len, headroom), chunk)
    first, logprob = _fetch((state.token, logprob))
    got = [[int(t)] for t in first]
    done = [max_new_tokens == 1 or ends(row) for row in got]
    yield [[int(t)] for t in first], [[float(x)] for x in logprob], None, None
    seq = np.zeros((b, max_len + headroom + 1), np.int32)
    seq[np.arange(b), lengths] = [row[0] for row in got]
    with model.mesh_context():
        rows = (seq, np.ones(b, np.int32), np.array(done), np.full(b, max_new_tokens, np.int32))
        loop = Ends(*model.place_rows(rows), stops=jnp.asarray(stop_table(tuple(map(tuple, ends.sequences)))))
    rounds, counts, chosen = 0, AcceptanceCounts.zeros(max(most, 1)), most
    while not all(done):
        todo = segment_rounds
        if auto:  # k is chosen every AUTO_SEGMENT rounds; a loop does not run past the next choice
            if rounds % AUTO_SEGMENT == 0:
                chosen = min(int(best_k(counts, jnp.asarray(costs, jnp.float32))), chosen + 1 if rounds else 1)
            todo = min(todo, AUTO_SEGMENT - rounds % AUTO_SEGMENT)
        # Every live round adds a token to each live row, so a row is at its limit after
        # max_new_tokens - 1 rounds: no more run, and the caches are sized for that (`sizes`).
        # One loop length (segment_rounds) for fixed k and auto: their loops at a k > 0 are one program.
        with model.mesh_context():
            loop = loop.replace(done=model.place_rows(jnp.asarray(done)))
            state, loop, log = run_rounds(c, dtype, chosen, mode, auto and not chosen, segment_rounds, model.params,
                                          sampling, state, loop, min(todo, max_new_tokens - 1 - rounds))
        log = _fetch(log)
        for committed, logprobs, accepted in zip(log.committed[:log.ran], log.logprobs[:log.ran],
                                                 log.accepted[:log.ran]):
            if all(done):  # stop strings the loop does not see ended the last rows
                break
            live = np.array([not d for d in done])
            rounds += 1
            counts = counts.update(chosen, jnp.asarray(accepted), jnp.asarray(live))
            new, new_logprobs = [[] for _ in range(b)], [[] for _ in range(b)]
            for i in np.flatnonzero(live):
                for t, lp in zip(committed[i, :accepted[i] + 1], logprobs[i]):
                    new[i].append(int(t))
                    new_logprobs[i].append(float(lp))
                    got[i].append(int(t))
                    if len(got[i]) >= max_new_tokens or ends(got[i]):
                        done[i] = True
                        break
            yield new, new_logprobs, chosen, accepted


def sizes(longest: int, max_new_tokens: int, most: int, chunk: int | None = None) -> tuple[int, int]:
    """(prompt width, cache positions) that `decode` uses by default: the longest prompt rounded up
    to whole chunks of `chunk` (None: one pass), and room past it for max_new_tokens rounds of up to
    `most` + 1 tokens each (rows that are done keep decoding)."""
    width = -(-longest // chunk) * chunk if chunk else longest
    return width, width + (max_new_tokens + 1) * (most + 1) + 1


class _Ends:
    """Whether a row's new tokens end it: they end with a stop sequence (the EOS ids are sequences
    of one), or their decoded text holds a stop string."""

    def __init__(self, sequences: tuple[tuple[int, ...], ...], strings: tuple[str, ...], tokenizer):
        if strings and tokenizer is None:
            raise InputError("stop strings need a tokenizer to decode the tokens (tokenizer=...)")
        self.sequences, self.strings, self.tokenizer = [list(s) for s in sequences], strings, tokenizer

    def __call__(self, tokens: list[int]) -> bool:
        if any(tokens[-len(s):] == s for s in self.sequences):
            return True
        return bool(self.strings) and any(s in self.tokenizer.decode(tokens) for s in self.strings)


def round_costs(model: V4Model, batch: int, cache_len: int, k_max: int, headroom: int | None = None) -> list[float]:
    """A greedy round's cost at k = 0..k_max (auto's round at k = 0 with its MTP repair) in plain
    rounds, for `batch` rows of caches of cache_len positions (and `headroom`, default k_max + 1):
    the figures jaxmtp.calibration keeps on disk for this model (config, dtype, how its kept weights
    multiply, its mesh), device and shape, else measured now (`calibration.measure`: each k between
    plain rounds, the median of its repeats) and kept. Rounds are timed in run_rounds' loops of
    AUTO_SEGMENT, as `decode` runs auto's (the same programs), each measurement from a copy of one
    prefilled state."""
    headroom = k_max + 1 if headroom is None else headroom
    mode, c, dtype = SamplingMode(), model.config, model.dtype
    matmuls = sorted({w.matmul for w in jax.tree.leaves(model.params, is_leaf=lambda v: isinstance(v, QuantizedWeight))
                      if isinstance(w, QuantizedWeight)})
    where = dict(model.mesh.shape) if model.mesh is not None else "one device"
    layout = f"deepseek_v4 loop|headroom {headroom}|matmul {matmuls}|mesh {where}"
    key = calibration.key(dataclasses.asdict(c), dtype, layout, mode, batch, 8, cache_len, k_max)
    known = calibration.stored(key, k_max)
    if known is not None:
        return known
    sampling = SamplingParams(temperature=jnp.float32(1), top_k=jnp.int32(1), top_p=jnp.float32(1))
    state = prefill(model, mode, sampling, jax.random.key(0), np.zeros((batch, 8), np.int32),
                    np.full(batch, 8, np.int32), model.new_caches(batch, cache_len, headroom),
                    model.new_mtp_cache(batch, cache_len, headroom))[0]

    def seconds(k: int, repair: bool) -> float:
        rows = (np.zeros((batch, cache_len + headroom + 1), np.int32), np.ones(batch, np.int32), np.zeros(batch, bool),
                np.full(batch, cache_len, np.int32))
        calls = max(calibration.ROUNDS // AUTO_SEGMENT, 1)
        with model.mesh_context():
            loop = (jax.tree.map(jnp.copy, state),  # the loop takes its state (donated)
                    Ends(*model.place_rows(rows), stops=jnp.asarray(stop_table(()))))
        jax.block_until_ready(loop)
        began = time.perf_counter()
        with model.mesh_context():
            for _ in range(calls):
                *loop, log = run_rounds(c, dtype, k, mode, repair, SEGMENT_ROUNDS, model.params, sampling, *loop,
                                        AUTO_SEGMENT)
                jax.block_until_ready(log)
        return (time.perf_counter() - began) / (calls * AUTO_SEGMENT)

    return calibration.measured(key, lambda: seconds(0, False), lambda k: seconds(k, k == 0), k_max)

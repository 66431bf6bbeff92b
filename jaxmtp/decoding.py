"""The traced generation loop: the prefill, then every decode round inside one jitted `lax.while_loop`.

Plain decoding is the k = 0 case of the speculative round: feed t_n, choose the next token. With
k > 0 each round drafts d1..dk with the MTP layer, verifies [t_n, d1..dk] in one main forward,
commits the accepted drafts plus one token, and repairs the MTP cache with the main model's hidden
states (the round of docs/speculative_decoding.md, "Rounds and k"). Rows advance independently:
every row has its own position n (the position of its newest token t_n, not yet fed to the
model), and the caches are addressed by absolute position, so a rejected draft is rolled back by
simply not advancing past it.

Everything here is traced; `jaxmtp.generation` pads the batch into `Inputs`, runs `start` (the
prefill) and `advance` (rounds, all of them or a chunk at a time for streaming) and unpacks the
`DecodeState`.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp

from jaxmtp.adaptive import AcceptanceCounts, best_k
from jaxmtp.cache import MLACache
from jaxmtp.config import ModelConfig
from jaxmtp.errors import InputError
from jaxmtp.generation_config import DEFAULT_PREFILL_CHUNK
from jaxmtp.layout import Layout
from jaxmtp.params import module
from jaxmtp.quant import is_quantized
from jaxmtp.sampling import SamplingMode, SamplingParams, choose, log_probabilities, split
from jaxmtp.sharding import context_mesh
from jaxmtp.speculative import verify_greedy, verify_sampled
from jaxmtp.transformer import DeepseekV3

AUTO_SEGMENT = 8  # speculative_k="auto" chooses k once every this many rounds
# Entries of the stop-sequence table: ANY pads a sequence on the left (matches every token), NEVER
# fills the table's unused rows (matches no token).
ANY, NEVER = -1, -2


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the compiled loop is specialised on. k: the drafts per round, or with `auto` the
    most that a round may draft (each round then chooses its own k in 0..k). logprobs: the loop
    keeps the log-probability of each emitted token. prefill_chunk: prompt positions prefilled at
    once (the prompt width is a multiple of it where it is wider)."""

    config: ModelConfig
    dtype: jnp.dtype
    k: int
    mode: SamplingMode
    cache_len: int
    layout: Layout
    auto: bool = False
    logprobs: bool = False
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK


@flax.struct.dataclass
class Inputs:
    """The traced arguments besides the parameters. B rows (padded), P prompt slots.

    prompt [B, P] (right-padded); lengths [B]; limits [B] (max new tokens); real [B] (False for
    batch padding rows); stops [N, L]: token sequences that end a row, right-aligned, left-padded
    with ANY, unused rows NEVER (EOS ids are sequences of one); sampling values; key; costs
    [k + 1]: round costs in plain steps and force_k: -1 or the k every round takes (auto only).
    """

    prompt: jax.Array
    lengths: jax.Array
    limits: jax.Array
    real: jax.Array
    stops: jax.Array
    sampling: SamplingParams
    key: jax.Array
    costs: jax.Array
    force_k: jax.Array


@flax.struct.dataclass
class Tokens:
    """Each row's tokens. B rows, W = S + k + 1 token slots (S = cache length).

    seq [B, W]: tokens by position (prompt, then generated); logprobs [B, W] (or None): the
    log-probability of each generated token at its position; n [B]: the position of t_n, the newest
    token, not yet fed to the model; count [B]: new tokens so far; done [B]."""

    seq: jax.Array
    logprobs: jax.Array | None
    n: jax.Array
    count: jax.Array
    done: jax.Array


@flax.struct.dataclass
class Drafts:
    """The MTP layer's state between rounds (k > 0). cache: its MLA cache; token [B]: d1, the first
    draft of the next round; hidden [B, D]: the MTP hidden state d1 came from (d2 is drafted from
    it); probs [B, V] (sampling only, else None): the distribution d1 was drawn from."""

    cache: MLACache
    token: jax.Array
    hidden: jax.Array
    probs: jax.Array | None

    def where(self, rows, other: Drafts) -> Drafts:
        """This d1 state for `rows` [B] (bool), other's elsewhere; this cache."""
        def pick(new, old):
            return jnp.where(rows.reshape(rows.shape + (1,) * (new.ndim - 1)), new.astype(old.dtype), old)

        return Drafts(cache=self.cache, token=pick(self.token, other.token), hidden=pick(self.hidden, other.hidden),
                      probs=None if self.probs is None else pick(self.probs, other.probs))


@flax.struct.dataclass
class AutoState:
    """What `speculative_k="auto"` carries between segments. main_hidden [B, R, D] (R =
    AUTO_SEGMENT): the main model's hidden states at positions n - R..n - 1 (those before position
    0 hold its), from which a segment at k > 0 after one at k = 0 refills the MTP slots and drafts
    d1 afresh; stale [] bool: the last segment ran at k = 0, so d1 needs that refill; segment_k []:
    the k of the last segment, 0 before the first."""

    main_hidden: jax.Array
    stale: jax.Array
    segment_k: jax.Array


@flax.struct.dataclass
class Stats:
    """Counts for `GenerationStats`, per row unless noted: rounds, drafted, accepted [B];
    accepted_at [B, k]: rounds in which draft i was accepted; rounds_at [B, k + 1]: rounds run at
    each k; steps []: main forward passes of the batch; counts: the batch's acceptance by draft
    position, from which `speculative_k="auto"` chooses k."""

    rounds: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    accepted_at: jax.Array
    rounds_at: jax.Array
    counts: AcceptanceCounts
    steps: jax.Array

    @classmethod
    def zeros(cls, batch: int, k: int) -> Stats:
        """No rounds yet, for `batch` rows and up to k drafts; steps counts the prefill."""
        rows = jnp.zeros((batch,), jnp.int32)
        return cls(rounds=rows, drafted=rows, accepted=rows, accepted_at=jnp.zeros((batch, k), jnp.int32),
                   rounds_at=jnp.zeros((batch, k + 1), jnp.int32), counts=AcceptanceCounts.zeros(k),
                   steps=jnp.ones((), jnp.int32))

    def after_round(self, k: int, k_max: int, accepted, active) -> Stats:
        """The counts after a round at k in which each row accepted `accepted` [B] drafts (rows
        not `active` [B] count nothing)."""
        return Stats(rounds=self.rounds + active, drafted=self.drafted + k * active,
                     accepted=self.accepted + accepted * active,
                     accepted_at=self.accepted_at + (jnp.arange(k_max) < accepted[:, None]) * active[:, None],
                     rounds_at=self.rounds_at.at[:, k].add(active), counts=self.counts.update(k, accepted, active),
                     steps=self.steps + 1)


@flax.struct.dataclass
class DecodeState:
    """The while-loop carry: tokens, the main stacks' caches (see `empty_caches`), drafts (k > 0,
    else None), auto (auto only, else None), stats and the random key."""

    tokens: Tokens
    caches: dict
    drafts: Drafts | None
    auto: AutoState | None
    stats: Stats
    key: jax.Array


def _apply(static: Static, params, *args, absorbed: bool = True, method):
    return module(static.config, static.dtype, absorbed, static.layout).apply({"params": params}, *args, method=method)


def main_forward(static, params, tokens, positions, caches, absorbed):
    """-> (logits [B, T, V] f32, post-norm hidden [B, T, D], caches)."""
    return _apply(static, params, tokens, positions, caches, absorbed=absorbed, method=DeepseekV3.__call__)


def _main_hidden(static, params, tokens, positions, caches, absorbed):
    """The main model without its head -> (post-norm hidden [B, T, D], caches)."""
    return _apply(static, params, tokens, positions, caches, absorbed=absorbed, method=DeepseekV3.hidden_states)


def _head(static, params, hidden):
    """hidden [B, D] -> logits [B, V] f32, for the one row per batch row that a choice needs."""
    return _apply(static, params, hidden[:, None], method=DeepseekV3.logits)[:, 0]


def mtp_step(static, params, hidden, next_tokens, positions, cache, absorbed):
    """-> (logits [B, T, V] f32, MTP hidden [B, T, D], cache)."""
    return _apply(static, params, hidden, next_tokens, positions, cache, absorbed=absorbed,
                  method=DeepseekV3.mtp_step)


def _mtp_hidden(static, params, hidden, next_tokens, positions, cache, absorbed):
    """The MTP module without the head -> (MTP hidden [B, T, D], cache)."""
    return _apply(static, params, hidden, next_tokens, positions, cache, absorbed=absorbed,
                  method=DeepseekV3.mtp_hidden)


def empty_caches(static: Static, batch: int):
    """The main stacks' caches: stacked [L, B, S, .] per group, or per-layer tuples when unrolled."""
    c = static.config
    groups = {"dense": c.num_dense_layers, "moe": c.num_moe_layers}
    if static.layout.unrolled:
        return {g: tuple(_rows_over_data(MLACache.zeros(c, None, batch, static.cache_len, static.dtype), batch_axis=0)
                         for _ in range(n)) for g, n in groups.items() if n}
    return {g: _rows_over_data(MLACache.zeros(c, n, batch, static.cache_len, static.dtype), batch_axis=1)
            for g, n in groups.items() if n}


def _rows_over_data(cache: MLACache, batch_axis: int) -> MLACache:
    """On a mesh (`jax.set_mesh`) whose data axis divides the batch, split the cache's rows over it;
    else the cache stays whole, as the batch's rows are placed (see jaxmtp.sharding.over_data_rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    data = 0 if mesh.empty else mesh.shape.get("data", 1)
    if data <= 1 or cache.c_kv.shape[batch_axis] % data:
        return cache
    spec = jax.sharding.PartitionSpec(*([None] * batch_axis), "data")
    return jax.lax.with_sharding_constraint(cache, spec)


def _unhoisted(static: Static, params, counter):
    """The parameters behind an optimization barrier with a loop counter, for a loop body: XLA then
    cannot hoist a conversion of weights (FP8 dequantization, a backend's widening of a dtype its
    products do not take) out of the loop as a converted copy of the whole model, which it would
    keep for the loop's lifetime. Models whose dense weights are unrolled (the small ones, whose
    weights need no conversion) keep XLA's hoisting."""
    if static.layout.unrolled and not is_quantized(params):
        return params
    return jax.lax.optimization_barrier((params, counter))[0]


def _rows_at(x, index):
    """x [B, T, ...], index [B, R] -> x[b, index[b, r]] [B, R, ...]."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _row_gather(x, index):
    """x [B, T, ...], index [B] -> x[b, index[b]] [B, ...]."""
    return _rows_at(x, index[:, None])[:, 0]


def _stopping(seq, n, count, width, stops):
    """Which of a round's `width` new tokens (at positions n+1..n+width of seq [B, W], already
    written there) complete a stop sequence -> [B, width] bool. A match lies wholly within the
    generated tokens (those from position n - count + 1 on); stops [N, L] as in `Inputs`, or one
    table per row [B, N, L]."""
    length = stops.shape[-1]
    stops = stops if stops.ndim == 2 else stops[:, None]  # [B, 1, N, L] against each row's windows
    ends = n[:, None] + 1 + jnp.arange(width)  # [B, T]
    at = ends[..., None] - (length - 1) + jnp.arange(length)  # [B, T, L]: each match window
    window = _rows_at(seq, jnp.maximum(at, 0).reshape(seq.shape[0], -1)).reshape(at.shape)
    generated = at >= (n - count + 1)[:, None, None]
    same = (window[:, :, None] == stops) & generated[:, :, None]  # [B, T, N, L]
    return ((stops == ANY) | same).all(axis=-1).any(axis=-1)


def _finish(seq, n, count, new_tokens, produced, limits, stops):
    """How many of a row's `produced` new tokens [B, T] (written to seq at positions n+1..n+T) to
    keep, and whether the row is now done: cut at max_new_tokens and just after the first token
    that completes a stop sequence."""
    slot = jnp.arange(new_tokens.shape[1])
    stop = _stopping(seq, n, count, new_tokens.shape[1], stops) & (slot < produced[:, None])
    first_stop = jnp.where(stop.any(axis=1), jnp.argmax(stop, axis=1) + 1, produced)
    kept = jnp.minimum(jnp.minimum(produced, first_stop), limits - count)
    return kept, stop.any(axis=1) | (count + kept >= limits)


def _token_logprobs(static: Static, logits, tokens, sampling):
    """logits [B, T, V], tokens [B, T] -> [B, T]: each token's log-probability under the
    distribution it was chosen from (the raw softmax when greedy)."""
    logp = log_probabilities(logits, static.mode, sampling)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


@flax.struct.dataclass
class _Prefilled:
    """What the prefill carries from chunk to chunk. seq [B, W]: the prompt, and the first new token
    at each row's length once its last prompt token has been passed; caches; first [B] and
    first_logprob [B] (or None); drafts (k > 0): d1 and the MTP state it came from (zeros before);
    main_hidden [B, R, D] (auto only): the main model's hidden states at positions last - R + 1..last
    (position 0's before position 0)."""

    seq: jax.Array
    caches: dict
    first: jax.Array
    first_logprob: jax.Array | None
    drafts: Drafts | None
    main_hidden: jax.Array | None


def prefill(static: Static, params, inputs: Inputs) -> DecodeState:
    """Main forward over the prompts, the first token, and (k > 0) the MTP first pass -> d1.

    Prompts longer than static.prefill_chunk are run a chunk of positions at a time in a loop: each
    chunk writes its cache entries and attends over the cache so far, so the prefill's temporaries
    depend on the chunk, not on the prompt. The MTP pass runs on each chunk right after the main
    pass; a row's first new token (which its last MTP slot reads) is chosen in the chunk that holds
    its last prompt position."""
    prompt, lengths = inputs.prompt, inputs.lengths
    batch, width = prompt.shape
    chunk = min(static.prefill_chunk, width)
    if width % chunk:
        raise InputError(f"prompt width {width} is not a multiple of the prefill chunk {chunk}")
    key, token_key, draft_key = split(inputs.key, 3)
    dtype, c, zeros = static.dtype, static.config, jnp.zeros_like(lengths)
    drafts = None
    if static.k:
        drafts = Drafts(cache=_rows_over_data(MLACache.zeros(c, None, batch, static.cache_len, dtype), 0),
                        token=zeros, hidden=jnp.zeros((batch, c.hidden_size), dtype),
                        probs=None if static.mode.greedy else jnp.zeros((batch, c.vocab_size), jnp.float32))
    carry = _Prefilled(
        seq=jnp.zeros((batch, static.cache_len + static.k + 1), jnp.int32).at[:, :width].set(prompt),
        caches=empty_caches(static, batch), first=zeros,
        first_logprob=jnp.zeros((batch,), jnp.float32) if static.logprobs else None, drafts=drafts,
        main_hidden=jnp.zeros((batch, AUTO_SEGMENT, c.hidden_size), dtype) if static.auto else None)
    keys = (token_key, draft_key)
    if chunk == width:
        carry = _prefill_chunk(static, params, inputs, carry, keys, 0, chunk)
    else:
        def body(i, carry):
            return _prefill_chunk(static, _unhoisted(static, params, i), inputs, carry, keys, i * chunk, chunk)

        carry = jax.lax.fori_loop(0, width // chunk, body, carry)
    last = lengths - 1
    kept, done = _finish(carry.seq, last, zeros, carry.first[:, None], jnp.ones_like(lengths), inputs.limits,
                         inputs.stops)
    kept, done = kept * inputs.real, done | ~inputs.real
    logprobs = None
    if static.logprobs:
        logprobs = jnp.zeros(carry.seq.shape, jnp.float32).at[jnp.arange(batch), lengths].set(carry.first_logprob)
    auto = None
    if static.auto:
        auto = AutoState(main_hidden=carry.main_hidden, stale=jnp.zeros((), bool), segment_k=jnp.zeros((), jnp.int32))
    return DecodeState(tokens=Tokens(seq=carry.seq, logprobs=logprobs, n=lengths, count=kept, done=done),
                       caches=carry.caches, drafts=carry.drafts, auto=auto, stats=Stats.zeros(batch, static.k), key=key)


def _prefill_chunk(static: Static, params, inputs: Inputs, carry: _Prefilled, keys, start, chunk: int,
                   draft: bool = True) -> _Prefilled:
    """The prefill over prompt positions start..start + chunk - 1 of every row (see `prefill`);
    without `draft`, the main model's only (the MTP cache and drafts are left as they are)."""
    batch, lengths, sampling = carry.seq.shape[0], inputs.lengths, inputs.sampling
    rows = jnp.arange(batch)
    positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
    tokens = jax.lax.dynamic_slice_in_dim(carry.seq, start, chunk, axis=1)
    hidden, caches = _main_hidden(static, params, tokens, positions, carry.caches, absorbed=False)
    last = lengths - 1
    here = (last >= start) & (last < start + chunk)  # [B]: the row's last prompt position is in this chunk
    at = jnp.clip(last - start, 0, chunk - 1)

    def sampled(_):
        logits = _head(static, params, _row_gather(hidden, at))
        first, _ = choose(keys[0], logits, static.mode, sampling)
        if not static.logprobs:
            return first, carry.first_logprob
        return first, _token_logprobs(static, logits[:, None], first[:, None], sampling)[:, 0]

    # The head and the first token's sampling (its sorts included) only in a chunk that ends some prompt.
    first, logprob = jax.lax.cond(jnp.any(here), sampled, lambda _: (carry.first, carry.first_logprob), None)
    first = jnp.where(here, first, carry.first)
    seq = carry.seq.at[rows, lengths].set(first)  # rows not yet at their end write the padding back
    carry = carry.replace(seq=seq, caches=caches, first=first)
    if static.logprobs:
        carry = carry.replace(first_logprob=jnp.where(here, logprob, carry.first_logprob))
    if static.auto:  # the hidden states at positions last - R + 1..last that lie in this chunk
        window = jnp.maximum(last[:, None] - AUTO_SEGMENT + 1 + jnp.arange(AUTO_SEGMENT), 0)  # [B, R]
        inside = (window >= start) & (window < start + chunk)
        picked = _rows_at(hidden, jnp.clip(window - start, 0, chunk - 1))
        carry = carry.replace(main_hidden=jnp.where(inside[..., None], picked.astype(carry.main_hidden.dtype),
                                                    carry.main_hidden))
    if static.k == 0 or not draft:
        return carry
    # MTP slot p pairs h_p with t_{p+1}; the slot of the last prompt token pairs it with `first`.
    next_tokens = jax.lax.dynamic_slice_in_dim(seq, start + 1, chunk, axis=1)
    drafts = _draft_from(static, params, (hidden, next_tokens, positions), carry.drafts.cache, at, keys[1], sampling)
    return carry.replace(drafts=drafts.where(here, carry.drafts))


def _draft_from(static: Static, params, rows, cache: MLACache, slot, key, sampling, absorbed: bool = False) -> Drafts:
    """The MTP pass over rows = (main hidden states [B, T, D], the tokens after them [B, T], their
    positions [B, T]), writing their slots of `cache`; the next d1, its MTP hidden state and its
    distribution come from row `slot` [B] (the head runs for that row only)."""
    z, cache = _mtp_hidden(static, params, *rows, cache, absorbed=absorbed)
    z = _row_gather(z, slot)
    token, probs = choose(key, _head(static, params, z), static.mode, sampling)
    return Drafts(cache=cache, token=token, hidden=z, probs=probs)


def refill_drafts(static: Static, params, state: DecodeState, sampling, key) -> Drafts:
    """The MTP pass over slots n - R..n - 1 (R = AUTO_SEGMENT), which pair the main model's hidden
    states there with the tokens after them, and d1 from slot n - 1, as the repair of the last
    round would have drafted it: after rounds at k = 0 the MTP cache lacks the positions they
    decoded and the draft is that of an earlier position. Where n < R the pass covers slots
    0..R - 1 instead (the cache write takes distinct, ascending positions); slots from n on get
    placeholder rows and are written again before any draft reads them."""
    n = state.tokens.n[:, None]
    positions = jnp.maximum(n - AUTO_SEGMENT, 0) + jnp.arange(AUTO_SEGMENT)  # [B, R]
    window = jnp.minimum(positions - (n - AUTO_SEGMENT), AUTO_SEGMENT - 1)  # index into main_hidden
    rows = (_rows_at(state.auto.main_hidden, window), _rows_at(state.tokens.seq, positions + 1), positions)
    slot = jnp.minimum(state.tokens.n, AUTO_SEGMENT) - 1  # the row of position n - 1
    return _draft_from(static, params, rows, state.drafts.cache, slot, key, sampling, absorbed=True)


def _draft_rest(static, k, params, n, drafts: Drafts, sampling, key):
    """d2..dk after d1 = drafts.token, for rows at positions n [B]: the MTP layer re-run on its own
    output hidden state, one position further each time. Unrolled (k <= 8): on CPU a `lax.scan`
    here costs more than the MTP steps themselves.

    Returns (drafts [B, k], their distributions [B, k, V] or None, MTP cache)."""
    token, hidden, cache = drafts.token, drafts.hidden, drafts.cache
    tokens, probs = [token], [drafts.probs]
    for j, step_key in enumerate(split(key, k - 1)):
        position = n + j  # d_{j+2} comes from MTP slot n + j
        logits, z, cache = mtp_step(static, params, hidden[:, None], token[:, None], position[:, None], cache,
                                    absorbed=True)
        token, p = choose(step_key, logits[:, 0], static.mode, sampling)
        hidden = z[:, 0]
        tokens.append(token)
        probs.append(p)
    return jnp.stack(tokens, axis=1), (None if static.mode.greedy else jnp.stack(probs, axis=1)), cache


def decode_round(static: Static, k: int, params, state: DecodeState, inputs: Inputs) -> DecodeState:
    """One round for every row at k <= static.k: draft (k > 0), verify in one main forward, accept,
    commit, repair. A round at k = 0 leaves the MTP state as it is."""
    t, batch, sampling = state.tokens, state.tokens.n.shape[0], inputs.sampling
    params = _unhoisted(static, params, state.stats.steps)
    key, draft_key, verify_key, next_key = split(state.key, 4)
    t_n = _row_gather(t.seq, t.n)
    if k:
        drafts, draft_probs, mtp_cache = _draft_rest(static, k, params, t.n, state.drafts, sampling, draft_key)
    else:
        drafts, draft_probs = jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0, static.config.vocab_size))
    tokens = jnp.concatenate([t_n[:, None], drafts], axis=1)  # [B, k+1]
    positions = t.n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    logits, hidden, caches = main_forward(static, params, tokens, positions, state.caches, absorbed=True)
    if static.mode.greedy:
        accepted, after = verify_greedy(drafts, logits)
    else:
        accepted, after = verify_sampled(verify_key, drafts, draft_probs, logits, static.mode, sampling)
    slot = jnp.arange(k + 1)
    new_tokens = jnp.where(slot < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), after[:, None])
    # All k + 1 slots are written; those past what a row keeps are overwritten before they are read.
    rows = jnp.arange(batch)[:, None]
    seq = t.seq.at[rows, positions + 1].set(new_tokens, mode="drop")
    active = ~t.done
    kept, finished = _finish(seq, t.n, t.count, new_tokens, accepted + 1, inputs.limits, inputs.stops)
    kept = kept * active
    logprobs = t.logprobs
    if static.logprobs:
        logprobs = logprobs.at[rows, positions + 1].set(_token_logprobs(static, logits, new_tokens, sampling),
                                                        mode="drop")
    state = state.replace(
        tokens=Tokens(seq=seq, logprobs=logprobs, n=t.n + kept, count=t.count + kept, done=t.done | finished),
        caches=caches, key=key, stats=state.stats.after_round(k, static.k, accepted, active))
    if static.auto:
        state = state.replace(auto=state.auto.replace(main_hidden=_shifted(state.auto.main_hidden, hidden, kept)))
    if k == 0:
        return state
    # Repair: MTP slots n..n+k from the verified hidden states; slot n+a yields the next d1 (the
    # head runs for that slot only).
    return state.replace(drafts=_draft_from(static, params, (hidden, new_tokens, positions), mtp_cache, accepted,
                                            next_key, sampling, absorbed=True))


def _shifted(window, hidden, kept):
    """The window of main hidden states [B, R, D] at positions n - R..n - 1, moved on by the round's
    kept [B] tokens, whose hidden states are hidden [B, k + 1, D] at positions n..n + k."""
    both = jnp.concatenate([window, hidden.astype(window.dtype)], axis=1)  # positions n - R..n + k
    return _rows_at(both, kept[:, None] + jnp.arange(window.shape[1]))


def _rounds(static: Static, params, state: DecodeState, inputs: Inputs) -> DecodeState:
    """The next round at static.k; or with `auto` the next AUTO_SEGMENT rounds (fewer once every
    row is done) at the k that `adaptive.best_k` says, but at most one more than the last segment's
    (or at force_k >= 0). The climb bounds what a wrong prior or a mispriced round costs: a call
    whose drafts are never accepted first tries k = 1, not the k that the prior's acceptance would
    pay best (benchmarks/useless_mtp.py measures that worst case).

    The auto segment is a chain, not a lax.switch between round variants: the refill of the MTP
    slots (a conditional, where k > 0), then one while loop per k, of which only the chosen k's
    runs any round. The state flows from each into the next, so XLA updates the caches in place
    (a switch whose branches hold loops makes XLA copy every cache twice per segment;
    tests/test_generate.py checks the compiled loop holds no such copy). XLA:GPU reads each
    loop's condition and the conditional's predicate on the host."""
    if not static.auto:
        return decode_round(static, static.k, params, state, inputs)
    k = jnp.minimum(best_k(state.stats.counts, inputs.costs), state.auto.segment_k + 1)
    k = jnp.where(inputs.force_k >= 0, inputs.force_k, k)

    def refill(state):  # the segment before may have run at k = 0
        key, draft_key = split(state.key, 2)
        return state.replace(key=key, drafts=refill_drafts(static, params, state, inputs.sampling, draft_key))

    # A conditional, not a loop run once: XLA would hoist the pass's projections out of such a loop
    # into every segment, k = 0 included. After a segment at k > 0 its last repair has written the
    # MTP slots and drafted d1 as the refill would, so the next segment skips the refill.
    state = jax.lax.cond((k > 0) & state.auto.stale, refill, lambda state: state, state)
    for j in range(static.k + 1):
        step = lambda carry, j=j: (carry[0] + 1, decode_round(static, j, params, carry[1], inputs))  # noqa: E731
        running = lambda carry, j=j: (k == j) & (carry[0] < AUTO_SEGMENT) & ~jnp.all(carry[1].tokens.done)  # noqa: E731
        state = jax.lax.while_loop(running, step, (jnp.int32(0), state))[1]
    return state.replace(auto=state.auto.replace(stale=k == 0, segment_k=k))


@partial(jax.jit, static_argnums=0)
def start(static: Static, params, inputs: Inputs) -> DecodeState:
    """The prefill: the state before the first round. Parameters placed on a mesh need it set
    (`Model.mesh_context`); without it this refuses them."""
    context_mesh(params, "decoding.start")
    return prefill(static, params, inputs)


@partial(jax.jit, static_argnums=0, donate_argnames="state")
def advance(static: Static, params, state: DecodeState, inputs: Inputs, steps, halt):
    """Rounds until every row is done, or until `steps` (a traced int) loop steps have run (a step
    is one round, or with auto a segment of up to AUTO_SEGMENT rounds). halt [B]: rows to end
    before the first step (stopped by the host). The state's buffers are reused (donated).

    Returns (the new state, a copy of its tokens: (seq, count, done)), the copy for the host to
    read while the next call already runs on the state. Parameters placed on a mesh need it set, as
    for `start`."""
    context_mesh(params, "decoding.advance")
    running = lambda carry: (carry[0] < steps) & ~jnp.all(carry[1].tokens.done)  # noqa: E731
    step = lambda carry: (carry[0] + 1, _rounds(static, params, carry[1], inputs))  # noqa: E731
    t = state.tokens
    state = state.replace(tokens=t.replace(done=t.done | halt))
    state = jax.lax.while_loop(running, step, (jnp.int32(0), state))[1]
    t = state.tokens
    return state, (t.seq + 0, t.count + 0, t.done | False)

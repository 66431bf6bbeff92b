"""The serving engine's compiled programs: a staging prefill, the insertion of a prefilled request
into a slot, decode segments over the live slots, and the prefix store's block copies.

The slots are the rows of one `DecodeState` (jaxmtp.decoding) of `slots` rows, with one random key
per row and per-row sampling values, stop table and token limit (`SlotParams`). A request is
prefilled in a batch-1 staging state (`Staging`) a chunk at a time, between segments, and copied
whole into its slot when its prompt is done (`insert`): the slot's rows of the caches are rewritten
from position 0, so whatever the slot's last request left there is overwritten or lies past the
new position, where attention masks it. A segment (`segment`) runs up to `rounds` rounds at one k
on the first `bucket` rows (the live slots are kept low), so that a round's cost follows the
number of live rows; rows that are free or that the host ended are marked done and advance no
further.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.cache import MLACache
from jaxmtp.decoding import (AUTO_SEGMENT, NEVER, DecodeState, Drafts, Inputs, Static, _finish, _prefill_chunk,
                             _Prefilled, _rows_at, decode_round, empty_caches, refill_drafts)
from jaxmtp.sampling import SamplingMode, SamplingParams
from jaxmtp.sharding import context_mesh

GREEDY = SamplingMode()
# The mode of the sampling programs: temperature, top-k and top-p per row (top_k = vocabulary and
# top_p = 1 turn a row's filters off), greedy rows marked in SamplingParams.greedy.
MIXED = SamplingMode(greedy=False, top_k=True, top_p=True)
CALIBRATION_SEED = 0  # of calibration_tokens


@flax.struct.dataclass
class SlotParams:
    """Per-slot settings read by every round. limits [B]: new tokens at most; stops [B, N, L]: stop
    tables (jaxmtp.decoding's ANY/NEVER convention); sampling: per-row values, greedy [B]."""

    limits: jax.Array
    stops: jax.Array
    sampling: SamplingParams


@flax.struct.dataclass
class Staging:
    """A request being prefilled (batch 1): its carry between chunks (seq [1, W] holds the prompt,
    then its first token), and its settings (lengths [1], limits [1], stops [1, N, L], sampling [1])."""

    carry: _Prefilled
    inputs: Inputs


def _rows(fn, *trees: DecodeState) -> DecodeState:
    """fn(axis, leaf, *other leaves) on every leaf of a DecodeState that has a batch axis (stacked
    caches [L, B, ...] have it at 1, the rest at 0); batch-wide leaves (the batch's acceptance
    counts, step count, auto's scalars) come from the first tree."""
    first = trees[0]

    def mapped(axis, *parts):
        return jax.tree.map(lambda *leaves: fn(axis, *leaves), *parts)

    caches = {g: (tuple(mapped(0, *layers) for layers in zip(*(t.caches[g] for t in trees)))
                  if isinstance(first.caches[g], tuple) else mapped(1, *(t.caches[g] for t in trees)))
              for g in first.caches}
    stats = first.stats.replace(**{name: mapped(0, *(getattr(t.stats, name) for t in trees))
                                   for name in ("rounds", "drafted", "accepted", "accepted_at", "rounds_at")})
    auto = first.auto.replace(main_hidden=mapped(0, *(t.auto.main_hidden for t in trees)))
    return first.replace(tokens=mapped(0, *(t.tokens for t in trees)), caches=caches,
                         drafts=None if first.drafts is None else mapped(0, *(t.drafts for t in trees)),
                         auto=auto, stats=stats, key=mapped(0, *(t.key for t in trees)))


def empty_slot_params(slots: int, stops_shape: tuple[int, int]) -> SlotParams:
    """Settings of `slots` free slots (host arrays): stop tables of stops_shape that match nothing."""
    ones = np.ones((slots,), np.float32)
    sampling = SamplingParams(ones, np.ones((slots,), np.int32), ones.copy(), np.ones((slots,), bool))
    return SlotParams(limits=np.ones((slots,), np.int32), stops=np.full((slots, *stops_shape), NEVER, np.int32),
                      sampling=sampling)


def unbounded(slot_params: SlotParams, live) -> SlotParams:
    """Calibration's settings: rows where live [B] is set have no token limit and no stop, and both
    sampling filters on (top-k 1, top-p 0.5), so that the sampling programs are timed with the
    filters running, which they skip where no row uses them (jaxmtp.sampling.probabilities)."""
    big = jnp.iinfo(jnp.int32).max // 2
    sampling = slot_params.sampling
    sampling = dataclasses.replace(sampling, top_k=jnp.where(live, 1, sampling.top_k),
                                   top_p=jnp.where(live, 0.5, sampling.top_p).astype(sampling.top_p.dtype))
    return slot_params.replace(limits=jnp.where(live, big, slot_params.limits),
                               stops=jnp.where(live[:, None, None], NEVER, slot_params.stops), sampling=sampling)


def live_sampling(sampling: SamplingParams, done, vocab: int) -> SamplingParams:
    """A segment's per-row sampling values [B] with both filters off in the rows done before it
    (done [B]): a free slot keeps its last request's settings, and a filter that only such rows
    set would run for every row (jaxmtp.sampling.probabilities skips a filter no row uses)."""
    return dataclasses.replace(sampling, top_k=jnp.where(done, vocab, sampling.top_k),
                               top_p=jnp.where(done, 1.0, sampling.top_p).astype(sampling.top_p.dtype))


def _index(axis: int, at):
    return (slice(None),) * axis + (at,)


def bucket_rows(halt: np.ndarray, bucket: int) -> np.ndarray:
    """The slots a segment of `bucket` rows runs (host): every slot in order for the largest bucket;
    for a smaller one the live slots (halt [S] unset), then free ones, each lowest first, so that
    the rows left in high slots when others finish run in a small bucket. -> [bucket] int32"""
    if bucket == len(halt):
        return np.arange(bucket, dtype=np.int32)
    return np.argsort(halt, kind="stable")[:bucket].astype(np.int32)


def take_rows(rows, bucket: int, slots: int):
    """(take(axis, leaf), put(axis, whole, part)) for a segment's rows [bucket] (bucket_rows):
    the leaf itself for the largest bucket, else those rows gathered and scattered back."""
    if bucket == slots:
        return (lambda axis, x: x), (lambda axis, whole, part: part)
    return (lambda axis, x: jnp.take(x, rows, axis=axis)), (lambda axis, whole, part: whole.at[_index(axis, rows)].set(part))


def by_slot(report, rows: np.ndarray, slots: int):
    """A segment's host report of its rows [bucket] (in `rows` order) as arrays over every slot [S, ...]
    (zeros for the slots it did not run)."""
    def spread(x):
        full = np.zeros((slots,) + x.shape[1:], x.dtype)
        full[rows] = x
        return full
    return jax.tree.map(spread, report)


def empty_slots(static: Static, slots: int) -> tuple[DecodeState, SlotParams]:
    """Every slot free (done, at position 0), one key per row; stop tables of `static`'s shape are
    made by the host (`SlotParams` from `stop_shape`)."""
    c, dtype = static.config, static.dtype
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731 (distinct buffers: the state is donated)
    drafts = None
    if static.k:
        drafts = Drafts(cache=MLACache.zeros(c, None, slots, static.cache_len, dtype), token=zeros(),
                        hidden=jnp.zeros((slots, c.hidden_size), dtype), probs=jnp.zeros((slots, c.vocab_size)))
    from jaxmtp.decoding import AutoState, Stats, Tokens

    width = static.cache_len + static.k + 1
    tokens = Tokens(seq=jnp.zeros((slots, width), jnp.int32), logprobs=jnp.zeros((slots, width), jnp.float32),
                    n=zeros(), count=zeros(), done=jnp.ones((slots,), bool))
    auto = AutoState(main_hidden=jnp.zeros((slots, AUTO_SEGMENT, c.hidden_size), dtype), stale=jnp.zeros((), bool),
                     segment_k=jnp.zeros((), jnp.int32))
    key = jax.random.split(jax.random.key(0), slots)
    state = DecodeState(tokens=tokens, caches=empty_caches(static, slots), drafts=drafts, auto=auto,
                        stats=Stats.zeros(slots, static.k), key=key)
    return _distinct(state)


def _distinct(tree):
    """Each leaf its own buffer (constructors share zeros between fields; a donated state may not)."""
    return jax.tree.map(lambda x: x.copy(), tree)


def empty_staging(static: Static, stops_shape: tuple[int, int]) -> Staging:
    """A batch-1 staging state with its caches, for `static` (its mode must be MIXED when k > 0, so
    that the first draft's distribution is kept for sampled rows)."""
    c, dtype = static.config, static.dtype
    zeros = lambda: jnp.zeros((1,), jnp.int32)  # noqa: E731 (distinct buffers: the state is donated)
    drafts = None
    if static.k:
        drafts = Drafts(cache=MLACache.zeros(c, None, 1, static.cache_len, dtype), token=zeros(),
                        hidden=jnp.zeros((1, c.hidden_size), dtype), probs=jnp.zeros((1, c.vocab_size)))
    carry = _Prefilled(seq=jnp.zeros((1, static.cache_len + static.k + 1), jnp.int32), caches=empty_caches(static, 1),
                       first=zeros(), first_logprob=jnp.zeros((1,), jnp.float32), drafts=drafts,
                       main_hidden=jnp.zeros((1, AUTO_SEGMENT, c.hidden_size), dtype))
    sampling = SamplingParams(jnp.ones((1,)), jnp.ones((1,), jnp.int32), jnp.ones((1,)), jnp.ones((1,), bool))
    inputs = Inputs(prompt=None, lengths=jnp.ones((1,), jnp.int32), limits=jnp.ones((1,), jnp.int32),
                    real=jnp.ones((1,), bool), stops=jnp.zeros((1, *stops_shape), jnp.int32), sampling=sampling,
                    key=jax.random.key(0), costs=None, force_k=None)
    return _distinct(Staging(carry=carry, inputs=inputs))


@partial(jax.jit, static_argnums=0, donate_argnames="staging")
def stage_begin(static: Static, staging: Staging, seq, inputs: Inputs) -> Staging:
    """A new request in the staging state: seq [1, W] its prompt (zeros after), inputs its settings
    (lengths [1], limits [1], stops [1, N, L], sampling [1], key: the request's own)."""
    return Staging(carry=staging.carry.replace(seq=seq), inputs=inputs)


@partial(jax.jit, static_argnums=(0, 1, 2), donate_argnames="staging")
def stage_chunk(static: Static, chunk: int, draft: bool, params, staging: Staging, start) -> Staging:
    """The prefill over staged prompt positions start..start + chunk - 1 (jaxmtp.decoding's chunk:
    main pass, MTP pass unless not `draft`, and the first token in the chunk that holds the last
    prompt position). Without the MTP pass the request's d1 is not drafted: its slot needs a refill
    (see `segment`) before a round at k > 0."""
    context_mesh(params, "engine.stage_chunk")
    _, token_key, draft_key = jax.random.split(staging.inputs.key, 3)
    with jax.named_scope("stage_chunk"):
        carry = _prefill_chunk(static, params, staging.inputs, staging.carry, (token_key, draft_key), start, chunk,
                               draft)
    return staging.replace(carry=carry)


@partial(jax.jit, static_argnums=0, donate_argnames="state")
def insert(static: Static, state: DecodeState, slot_params: SlotParams, staging: Staging, slot):
    """The staged request into row `slot` (traced) of the slots: its caches, MTP state, tokens
    (prompt, first token), settings and key; its stats from zero. -> (state, slot_params, (first
    token [], its log-probability [], done [] bool))."""
    carry, inputs = staging.carry, staging.inputs
    last = inputs.lengths - 1
    zeros = jnp.zeros_like(inputs.lengths)
    kept, done = _finish(carry.seq, last, zeros, carry.first[:, None], jnp.ones_like(zeros), inputs.limits, inputs.stops)
    logprobs = jnp.zeros(carry.seq.shape, jnp.float32).at[0, inputs.lengths[0]].set(carry.first_logprob[0])
    _, row_key = jax.random.split(jax.random.split(inputs.key, 3)[0])
    row = state.replace(
        tokens=state.tokens.replace(seq=carry.seq, logprobs=logprobs, n=inputs.lengths, count=kept, done=done),
        caches=carry.caches, drafts=carry.drafts,
        auto=state.auto.replace(main_hidden=carry.main_hidden),
        stats=state.stats.replace(rounds=zeros, drafted=zeros, accepted=zeros,
                                  accepted_at=jnp.zeros((1, static.k), jnp.int32),
                                  rounds_at=jnp.zeros((1, static.k + 1), jnp.int32)),
        key=row_key[None])

    def put(axis, full, one):
        return full.at[_index(axis, slot)].set(jnp.take(one, 0, axis=axis).astype(full.dtype))

    state = _rows(put, state, row)
    slot_params = jax.tree.map(lambda full, one: full.at[slot].set(one[0].astype(full.dtype)), slot_params,
                               SlotParams(limits=inputs.limits, stops=inputs.stops, sampling=inputs.sampling))
    return state, slot_params, (carry.first[0], carry.first_logprob[0], done[0])


@flax.struct.dataclass
class Report:
    """What a segment hands the host, for the bucket's rows. n, count [b]; done [b]; recent [b, M] and
    recent_logprobs [b, M]: the tokens (and log-probabilities) at positions n - M + 1..n; rounds [b],
    accepted_at [b, k], rounds_at [b, k + 1]: the rows' counts since their insertion."""

    n: jax.Array
    count: jax.Array
    done: jax.Array
    recent: jax.Array
    recent_logprobs: jax.Array
    rounds: jax.Array
    accepted_at: jax.Array
    rounds_at: jax.Array


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnames="state")
def segment(static: Static, bucket: int, window: int, ks: tuple[int, ...], refills: bool, params,
            state: DecodeState, slot_params: SlotParams, k, rounds, refill, halt, early, rows):
    """Up to `rounds` rounds at k (traced, one of ks) on the slots rows [bucket] (bucket_rows);
    fewer once every row is done, or with `early` once a row that was running finishes (requests
    wait for its slot).
    ks: the k the program holds a loop of (an engine of fixed k runs that k alone; auto's segments
    at k = 0 run a program of (0,), its others one of every k > 0: Device._segment_state).
    refills: whether the program refills (an engine that also runs k = 0, where a row's MTP state
    can fall behind); then refill [B] marks rows whose MTP slots of the last AUTO_SEGMENT positions
    are written and d1 drafted afresh first, where k > 0 (their last segment ran at k = 0, or their
    prefill skipped the MTP pass); every row's key is split when any row refills.
    halt [B]: rows the host ended (or free), done before the first round.
    static.mode: GREEDY (every live row greedy) or MIXED.

    Returns (state, slot_params, Report of the bucket's rows, in `rows` order, with M = window)."""
    context_mesh(params, "engine.segment")
    take, put = take_rows(rows, bucket, halt.shape[0])
    sub = _rows(take, state)
    inputs = jax.tree.map(lambda x: take(0, x), slot_params)
    probs = None
    if static.mode.greedy and sub.drafts is not None:  # the greedy program carries no draft distributions
        probs = sub.drafts.probs
        sub = sub.replace(drafts=sub.drafts.replace(probs=None))
    t = sub.tokens
    halted = take(0, halt)
    started_done = t.done | halted
    inputs = inputs.replace(sampling=live_sampling(inputs.sampling, started_done, static.config.vocab_size))
    # Halted rows (free, or ended by the host) restart from position 0, so that the attention's
    # prefix (layout.prefix_attention: the shortest holding every row's position) follows the live rows.
    sub = sub.replace(tokens=t.replace(done=started_done, n=jnp.where(halted, 0, t.n)))
    if refills:
        stale = take(0, refill) & ~started_done

        def refilled(sub):
            keys = jax.vmap(jax.random.split)(sub.key)  # [b, 2]
            fresh = refill_drafts(static, params, sub, inputs.sampling, keys[:, 1])
            pick = lambda new, old: jnp.where(stale.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
            return sub.replace(key=keys[:, 0], drafts=jax.tree.map(pick, fresh, sub.drafts))

        sub = jax.lax.cond(jnp.any(stale) & (k > 0), refilled, lambda sub: sub, sub)
    with jax.named_scope("segment"):
        for j in ks:
            def step(carry, j=j):
                return carry[0] + 1, decode_round(static, j, params, carry[1], inputs)

            def running(carry, j=j):
                done = carry[1].tokens.done
                ended = early & jnp.any(done & ~started_done)
                return (k == j) & (carry[0] < rounds) & ~jnp.all(done) & ~ended

            sub = jax.lax.while_loop(running, step, (jnp.int32(0), sub))[1]
    if probs is not None:
        sub = sub.replace(drafts=sub.drafts.replace(probs=probs))
    state = _rows(put, state, sub)
    t = sub.tokens
    at = jnp.maximum(t.n[:, None] - window + 1 + jnp.arange(window), 0)
    s = sub.stats
    report = Report(n=t.n, count=t.count, done=t.done, recent=_rows_at(t.seq, at), recent_logprobs=_rows_at(t.logprobs, at),
                    rounds=s.rounds, accepted_at=s.accepted_at, rounds_at=s.rounds_at)
    return state, slot_params, report


@partial(jax.jit, static_argnums=0, donate_argnames="state")
def occupy(static: Static, state: DecodeState, slot_params: SlotParams, bucket_rows, position):
    """Calibration only: rows where bucket_rows [B] is set run from `position` with no limit or stop
    (whatever their caches hold), so that a segment times `bucket` live rows; the others are done.
    The live rows' tokens (and first drafts) become seeded random ids (calibration_tokens)."""
    t = state.tokens
    live = bucket_rows
    seq = jnp.where(live[:, None], calibration_tokens(static.config.vocab_size, t.seq.shape, position), t.seq)
    state = state.replace(tokens=t.replace(seq=seq, n=jnp.where(live, position, t.n),
                                           count=jnp.where(live, 0, t.count), done=~live))
    if state.drafts is not None:
        drafts = jnp.where(live, calibration_tokens(static.config.vocab_size, t.n.shape, position + 1),
                           state.drafts.token)
        state = state.replace(drafts=state.drafts.replace(token=drafts))
    return state, unbounded(slot_params, live)


def calibration_tokens(vocab: int, shape: tuple[int, ...], seed) -> jax.Array:
    """Seeded random token ids of `shape` for calibration to run on. Ids alike in every row and
    position (zeros) would send every token to the same routed experts, and a round of
    several rows or a verify pass of several positions would be timed running fewer experts than
    text runs it with: under serving such rounds then cost more than calibration measured, and
    auto drafted where plain decoding was faster (benchmarks/serving.py at concurrency 1)."""
    return jax.random.randint(jax.random.fold_in(jax.random.key(CALIBRATION_SEED), seed), shape, 0, vocab, jnp.int32)


@partial(jax.jit, donate_argnames="pool")
def store_blocks(pool, caches, blocks, entries):
    """Copies cache blocks into the prefix store. caches: a batch-1 pytree of MLACaches (leaves
    [..., 1, S, X]); pool: the same pytree with leaves [..., P, block, X]; blocks [m]: the block
    numbers to copy (positions b * block..), entries [m]: their pool entries (P or more: skipped)."""
    def put(store, cache):
        size = store.shape[-2]
        cache = jnp.take(cache, 0, axis=-3)  # [..., S, X]
        shaped = cache.reshape(cache.shape[:-2] + (cache.shape[-2] // size, size, cache.shape[-1]))
        taken = jnp.take(shaped, blocks, axis=-3)  # [..., m, block, X]
        index = (slice(None),) * (store.ndim - 3) + (entries,)
        return store.at[index].set(taken, mode="drop")

    return jax.tree.map(put, pool, caches)


@partial(jax.jit, donate_argnames="caches")
def load_blocks(caches, pool, entries, count):
    """The prefix store's entries [m] into blocks 0..count - 1 of batch-1 caches (the inverse of
    store_blocks); blocks from count on are left as they are."""
    def get(cache, store):
        size = store.shape[-2]
        one = jnp.take(cache, 0, axis=-3)
        shaped = one.reshape(one.shape[:-2] + (one.shape[-2] // size, size, one.shape[-1]))
        taken = jnp.take(store, entries, axis=-3, mode="clip")  # [..., m, block, X]
        m = entries.shape[0]
        keep = (jnp.arange(m) < count).reshape((m, 1, 1))
        axis = shaped.ndim - 3
        head = jax.lax.slice_in_dim(shaped, 0, m, axis=axis)
        shaped = jax.lax.dynamic_update_slice_in_dim(shaped, jnp.where(keep, taken, head), 0, axis=axis)
        return jnp.expand_dims(shaped.reshape(one.shape), -3)

    return jax.tree.map(get, caches, pool)

"""The serving engine's device side for DeepSeek-V4: the same operations as `device.Device` (a
staging prefill, insertion into a slot, decode segments, calibration's occupancy), on V4's
programs (jaxmtp.models.deepseek_v4.speculative), so that `Engine` batches V4 requests
continuously as it does the V3 family's.

The slots are the rows of one `RoundState` of `slots` rows (caches stored by position, one random
key per row), with each row's tokens by position, its count of new tokens and its statistics
(`Slots`), and per-row sampling values, stop table and token limit (`programs.SlotParams`). A
request is prefilled in a batch-1 staging state (`Staged`) a chunk at a time; `insert` chooses its
first token, runs the MTP block over the prompt's last positions (its first draft) and copies the
row into its slot whole. A segment runs up to `rounds` rounds at one k on `bucket` rows (programs.bucket_rows);
rows that are done keep their position. Auto's rounds at k = 0 repair the MTP cache, as
`speculative.decode`'s do, so a slot's drafts are never stale: the engine's refill mask is not
needed here.

Prefix reuse: V4's caches hold compressed entries by position and ring buffers of the latest
positions (the sliding window, the pools' partly filled blocks). A store entry of chunk j holds
the chunk's compressed entries and the rings as they are once the prefill has passed the chunk's
last position, so the engine stores each chunk right after prefilling it (`store`), and loading n
chunks copies their entries and the rings of chunk n - 1 (`load`). The chunk must be a multiple of
every compression rate.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.decoding import _finish, _rows_at
from jaxmtp.engine import programs
from jaxmtp.engine.device import BEGIN, CHUNK, FRESH, INSERT, LOAD, OCCUPY, SEGMENT, STORE, Device, _bits, _fetch
from jaxmtp.models.deepseek_v4.attention import LayerCache, PoolCache
from jaxmtp.models.deepseek_v4.speculative import RoundState, prefill_chunk, prefill_finish, run_round
from jaxmtp.models.deepseek_v4.transformer import segments
from jaxmtp.sampling import SamplingMode, SamplingParams, choose, log_probabilities, split
from jaxmtp.sharding import context_mesh


@dataclasses.dataclass(frozen=True)
class V4Static:
    """What V4's engine programs are specialised on: config, dtype, k (the most drafts a round
    may make), cache_len (cache positions; headroom k + 1 past them)."""

    config: object
    dtype: object
    k: int
    cache_len: int


@flax.struct.dataclass
class Slots:
    """The slots' rows. state: their RoundState; seq [S, W] and logprobs [S, W]: tokens by position
    (prompt, then new tokens) and the new tokens' log-probabilities; first [S]: the position of a
    row's first new token; count [S]: its new tokens; done [S]; rounds [S], accepted_at [S, k],
    rounds_at [S, k + 1]: its rounds since insertion."""

    state: RoundState
    seq: jax.Array
    logprobs: jax.Array
    first: jax.Array
    count: jax.Array
    done: jax.Array
    rounds: jax.Array
    accepted_at: jax.Array
    rounds_at: jax.Array


@flax.struct.dataclass
class Staged:
    """A request being prefilled (batch 1): caches and mtp_cache (None without drafting); window
    [1, S, N, D] and last [1, V] as speculative.prefill_chunk keeps them; prompt [1, W]; length,
    limit [1]; stops [1, N, L]; sampling (one row); key [1]."""

    caches: tuple
    mtp_cache: object
    window: jax.Array
    last: jax.Array
    prompt: jax.Array
    length: jax.Array
    limit: jax.Array
    stops: jax.Array
    sampling: SamplingParams
    key: jax.Array


def _rows(fn, *trees):
    """fn(axis, *leaves) on every leaf of Slots (the main caches' rows are axis 1 of their
    stacked [repeats, B, ...] leaves, every other leaf's axis 0)."""
    first = trees[0]

    def mapped(axis, *parts):
        return jax.tree.map(lambda *leaves: fn(axis, *leaves), *parts)

    state = first.state.replace(**{name: mapped(0, *(getattr(t.state, name) for t in trees))
                                   for name in ("mtp_cache", "n", "token", "draft", "draft_probs", "recycled", "key")})
    state = state.replace(caches=mapped(1, *(t.state.caches for t in trees)))
    rest = {name: mapped(0, *(getattr(t, name) for t in trees))
            for name in ("seq", "logprobs", "first", "count", "done", "rounds", "accepted_at", "rounds_at")}
    return first.replace(state=state, **rest)


def _finish_state(static: V4Static, params, staged: Staged):
    """The staged request's first token and, with an MTP block and k > 0, its first draft:
    -> (RoundState of one row, the token's log-probability [1])."""
    mode, c = programs.MIXED, static.config
    if static.k:
        return prefill_finish(c, static.dtype, mode, params, staged.sampling, staged.key, staged.prompt, staged.length,
                              staged.window, staged.last, staged.mtp_cache)
    first_key, key = split(staged.key, 2)
    token, _ = choose(first_key, staged.last, mode, staged.sampling)
    logprob = jnp.take_along_axis(log_probabilities(staged.last, mode, staged.sampling), token[:, None], axis=-1)[:, 0]
    return RoundState(caches=(), mtp_cache=None, n=staged.length, token=token, draft=jnp.zeros_like(token),
                      draft_probs=None, recycled=None, key=key), logprob


def empty_slots(static: V4Static, slots: int, mtp_cache, caches) -> Slots:
    """Every slot free (done, at position 0), one key per row. caches, mtp_cache: the model's
    empty caches for `slots` rows (V4Model.new_caches, new_mtp_cache; None without drafting)."""
    c = static.config
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731 (distinct buffers: the state is donated)
    width = static.cache_len + static.k + 1
    state = RoundState(caches=caches, mtp_cache=mtp_cache, n=zeros(), token=zeros(), draft=zeros(),
                       draft_probs=jnp.zeros((slots, c.vocab_size)) if static.k else None,
                       recycled=jnp.zeros((slots, 1, c.hc_mult, c.hidden_size), static.dtype) if static.k else None,
                       key=jax.random.split(jax.random.key(0), slots))
    return Slots(state=state, seq=jnp.zeros((slots, width), jnp.int32), logprobs=jnp.zeros((slots, width)),
                 first=zeros(), count=zeros(), done=jnp.ones((slots,), bool), rounds=zeros(),
                 accepted_at=jnp.zeros((slots, static.k), jnp.int32),
                 rounds_at=jnp.zeros((slots, static.k + 1), jnp.int32))


@partial(jax.jit, static_argnums=0, donate_argnames="staged")
def stage_begin(static: V4Static, staged: Staged, empty, prompt, length, limit, stops, sampling, key) -> Staged:
    """A new request in the staging state, its caches copied from `empty` ((caches, mtp_cache) as
    new: their rings mark every row unwritten): prompt [1, W] (zeros after its length [1]), limit
    [1], stops [1, N, L], sampling (one row), key [1]."""
    caches, mtp_cache = jax.tree.map(jnp.copy, empty)
    return staged.replace(caches=caches, mtp_cache=mtp_cache, window=jnp.zeros_like(staged.window),
                          last=jnp.zeros_like(staged.last), prompt=prompt, length=length, limit=limit, stops=stops,
                          sampling=sampling, key=key)


@partial(jax.jit, static_argnums=(0, 1), donate_argnames="staged")
def stage_chunk(static: V4Static, chunk: int, params, staged: Staged, start) -> Staged:
    """The prefill over staged prompt positions start..start + chunk - 1 (speculative.prefill_chunk)."""
    context_mesh(params, "engine.v4.stage_chunk")
    tokens = jax.lax.dynamic_slice_in_dim(staged.prompt, start, chunk, axis=1)
    with jax.named_scope("stage_chunk"):
        caches, window, last = prefill_chunk(static.config, static.dtype, params, tokens, start, staged.length,
                                             staged.caches, staged.window, staged.last)
    return staged.replace(caches=caches, window=window, last=last)


@partial(jax.jit, static_argnums=0, donate_argnames="slots")
def insert(static: V4Static, params, slots: Slots, slot_params: programs.SlotParams, staged: Staged, slot):
    """The staged request into row `slot` (traced): its first token chosen, its first draft made (k > 0),
    its caches and settings copied. -> (slots, slot_params, (first token [], its log-probability [],
    done [] bool))."""
    context_mesh(params, "engine.v4.insert")
    state, logprob = _finish_state(static, params, staged)
    zeros = jnp.zeros_like(staged.length)
    first = staged.length
    seq = staged.prompt.at[0, first[0]].set(state.token[0])
    kept, done = _finish(seq, first - 1, zeros, state.token[:, None], jnp.ones_like(zeros), staged.limit, staged.stops)
    row = Slots(state=state.replace(caches=staged.caches), seq=seq,
                logprobs=jnp.zeros(seq.shape).at[0, first[0]].set(logprob[0]), first=first, count=kept, done=done,
                rounds=zeros, accepted_at=jnp.zeros((1, static.k), jnp.int32),
                rounds_at=jnp.zeros((1, static.k + 1), jnp.int32))

    def put(axis, full, one):
        return full.at[programs._index(axis, slot)].set(jnp.take(one, 0, axis=axis).astype(full.dtype))

    slots = _rows(put, slots, row)
    slot_params = jax.tree.map(lambda full, one: full.at[slot].set(one[0].astype(full.dtype)), slot_params,
                               programs.SlotParams(limits=staged.limit, stops=staged.stops, sampling=staged.sampling))
    return slots, slot_params, (state.token[0], logprob[0], done[0])


def _round(static: V4Static, j: int, mode: SamplingMode, params, sub: Slots, inputs: programs.SlotParams) -> Slots:
    """One round at k = j on the live rows of `sub`: their tokens, log-probabilities, counts, stops
    and statistics; rows that are done keep their position."""
    b = sub.done.shape[0]
    n, live = sub.state.n, ~sub.done
    state, committed, logprobs, accepted = run_round(static.config, static.dtype, j, mode, static.k > 0, params,
                                                     inputs.sampling, sub.state)
    state = state.replace(n=jnp.where(live, state.n, n))
    width = sub.seq.shape[1]
    at = jnp.where(live[:, None], n[:, None] + 1 + jnp.arange(j + 1), width)  # done rows write nothing
    rows = jnp.arange(b)[:, None]
    seq = sub.seq.at[rows, at].set(committed, mode="drop")
    kept, stopped = _finish(seq, n, sub.count, committed, jnp.where(live, accepted + 1, 0), inputs.limits,
                            inputs.stops)
    tried = live[:, None] & (jnp.arange(j)[None] < accepted[:, None])
    return sub.replace(state=state, seq=seq, logprobs=sub.logprobs.at[rows, at].set(logprobs, mode="drop"),
                       count=sub.count + kept, done=sub.done | stopped, rounds=sub.rounds + live,
                       accepted_at=sub.accepted_at.at[:, :j].add(tried.astype(jnp.int32)),
                       rounds_at=sub.rounds_at.at[:, j].add(live.astype(jnp.int32)))


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnames="slots")
def segment(static: V4Static, mode: SamplingMode, bucket: int, window: int, ks: tuple[int, ...], params,
            slots: Slots, slot_params: programs.SlotParams, k, rounds, halt, early, rows):
    """Up to `rounds` rounds at k (traced, one of ks: programs.segment) on the slots rows [bucket]
    (programs.bucket_rows); fewer once every row is done, or with `early` once a row that was
    running finishes. halt [S]: rows the host ended (or free), done before the first round. ->
    (slots, slot_params, programs.Report of the bucket's rows in `rows` order with M = window: the
    tokens at the M positions up to each row's last new one)."""
    context_mesh(params, "engine.v4.segment")
    take, put = programs.take_rows(rows, bucket, halt.shape[0])
    sub = _rows(take, slots)
    inputs = jax.tree.map(lambda x: take(0, x), slot_params)
    probs = sub.state.draft_probs
    if mode.greedy and probs is not None:  # the greedy program carries no draft distributions
        sub = sub.replace(state=sub.state.replace(draft_probs=None))
    started_done = sub.done | take(0, halt)
    sub = sub.replace(done=started_done)
    inputs = inputs.replace(sampling=programs.live_sampling(inputs.sampling, started_done, static.config.vocab_size))
    with jax.named_scope("segment"):
        for j in ks:
            def step(carry, j=j):
                return carry[0] + 1, _round(static, j, mode, params, carry[1], inputs)

            def running(carry, j=j):
                done = carry[1].done
                ended = early & jnp.any(done & ~started_done)
                return (k == j) & (carry[0] < rounds) & ~jnp.all(done) & ~ended

            sub = jax.lax.while_loop(running, step, (jnp.int32(0), sub))[1]
    if mode.greedy and probs is not None:
        sub = sub.replace(state=sub.state.replace(draft_probs=probs))
    slots = _rows(put, slots, sub)
    last = sub.first + sub.count - 1
    at = jnp.clip(last[:, None] - window + 1 + jnp.arange(window), 0, sub.seq.shape[1] - 1)
    report = programs.Report(n=last, count=sub.count, done=sub.done, recent=_rows_at(sub.seq, at),
                             recent_logprobs=_rows_at(sub.logprobs, at), rounds=sub.rounds,
                             accepted_at=sub.accepted_at, rounds_at=sub.rounds_at)
    return slots, slot_params, report


@partial(jax.jit, static_argnums=0, donate_argnames="slots")
def occupy(static: V4Static, slots: Slots, slot_params: programs.SlotParams, bucket_rows, position):
    """Calibration only: rows where bucket_rows [S] is set run from `position` with no limit or stop
    (whatever their caches hold); the others are done. The live rows' tokens and first drafts become
    seeded random ids (programs.calibration_tokens)."""
    live = bucket_rows
    state = slots.state
    vocab, rows = static.config.vocab_size, state.n.shape
    state = state.replace(n=jnp.where(live, position, state.n),
                          token=jnp.where(live, programs.calibration_tokens(vocab, rows, position), state.token),
                          draft=jnp.where(live, programs.calibration_tokens(vocab, rows, position + 1), state.draft))
    slots = slots.replace(state=state,
                          first=jnp.where(live, position + 1, slots.first), count=jnp.where(live, 0, slots.count),
                          done=~live)
    return slots, programs.unbounded(slot_params, live)


def rates(config, caches) -> tuple:
    """The main caches' tree [segments][unit layers] with each leaf's positions per entry: a pool's
    compressed entries its compression rate, the ring buffers 0."""
    def layer(kind, cache: LayerCache) -> LayerCache:
        def pool(p):
            return None if p is None else PoolCache(kv=0, gate=0, pos=0, entries=config.compress_rate(kind))

        return LayerCache(window=0, window_pos=0, compressor=pool(cache.compressor), indexer=pool(cache.indexer))

    return tuple(tuple(layer(kind, cache) for (kind, _), cache in zip(segment.kinds, held))
                 for segment, held in zip(segments(config), caches))


def empty_pool(config, caches, entries: int, block: int):
    """The prefix store for `entries` chunks of `block` positions, for batch-1 caches (leaves
    [repeats, 1, ...]): compressed entries [repeats, entries, block / rate, ...], rings [repeats,
    entries, ...]."""
    def one(leaf, rate):
        shape = (leaf.shape[0], entries) + ((block // rate,) if rate else (leaf.shape[2],)) + leaf.shape[3:]
        return jnp.zeros(shape, leaf.dtype)

    return jax.tree.map(one, caches, rates(config, caches))


@partial(jax.jit, static_argnums=(0, 1), donate_argnames="pool")
def store_block(config, block: int, pool, caches, chunk, entry):
    """Chunk `chunk` of the batch-1 caches into store entry `entry` (past the store's end: skipped):
    its compressed entries, and the rings as they are now (the prefill has just passed the chunk)."""
    def put(store, cache, rate):
        cache = cache[:, 0]
        if rate:
            cache = jax.lax.dynamic_slice_in_dim(cache, chunk * (block // rate), block // rate, axis=1)
        return store.at[:, entry].set(cache, mode="drop")

    return jax.tree.map(put, pool, caches, rates(config, caches))


@partial(jax.jit, static_argnums=0, donate_argnames="caches")
def load_blocks(config, caches, pool, entries, count):
    """Store entries[:count] as chunks 0..count - 1 of the batch-1 caches (entries: one per cache
    chunk): their compressed entries, and the rings of chunk count - 1 (none when count is 0)."""
    def get(cache, store, rate):
        if not rate:
            ring = jnp.take(store, jnp.maximum(count - 1, 0), axis=1)[:, None]
            return jnp.where(count > 0, ring.astype(cache.dtype), cache)
        taken = jnp.take(store, entries, axis=1, mode="clip")  # [r, m, block / rate, ...]
        taken = taken.reshape((taken.shape[0], 1, -1) + taken.shape[3:])[:, :, :cache.shape[2]]
        chunk = store.shape[2]
        keep = (jnp.arange(taken.shape[2]) < count * chunk).reshape((1, 1, -1) + (1,) * (cache.ndim - 3))
        head = jax.lax.slice_in_dim(cache, 0, taken.shape[2], axis=2)
        return jax.lax.dynamic_update_slice_in_dim(cache, jnp.where(keep, taken, head), 0, axis=2)

    return jax.tree.map(get, caches, pool, rates(config, caches))


class V4Device(Device):
    """`device.Device`'s operations on a DeepSeek-V4 model (see the module's docstring); the
    lockstep across processes is Device's."""

    def __init__(self, settings, model):
        super().__init__(settings)
        self.model = model

    def fresh(self):
        self._send(FRESH)
        s, static, model = self.s, self.s.static, self.model
        headroom = static.k + 1
        mtp_cache = model.new_mtp_cache(s.slots, static.cache_len, headroom) if static.k else None
        self.state = empty_slots(static, s.slots, mtp_cache, model.new_caches(s.slots, static.cache_len, headroom))
        self.params = model.place_rows(jax.tree.map(jnp.asarray, programs.empty_slot_params(s.slots, s.stops)))
        c, width = static.config, static.cache_len + static.k + 1
        span = min(c.sliding_window, width)  # the prompt positions whose streams the MTP block reads
        # Empty batch-1 caches, copied into the staging state for each request (stage_begin).
        self.empty = (model.new_caches(1, static.cache_len, headroom),
                      model.new_mtp_cache(1, static.cache_len, headroom) if static.k else None)
        one = jax.tree.map(jnp.asarray, programs.empty_slot_params(1, s.stops))
        self.staging = Staged(caches=jax.tree.map(jnp.copy, self.empty[0]),
                              mtp_cache=jax.tree.map(jnp.copy, self.empty[1]),
                              window=jnp.zeros((1, span, c.hc_mult, c.hidden_size), static.dtype),
                              last=jnp.zeros((1, c.vocab_size), jnp.float32), prompt=jnp.zeros((1, width), jnp.int32),
                              length=jnp.ones((1,), jnp.int32), limit=one.limits, stops=one.stops,
                              sampling=one.sampling, key=jax.random.split(jax.random.key(0), 1))
        self.spares = [jax.tree.map(jnp.copy, self.staging) for _ in range(s.stagings - 1)]
        self.pool = None
        if s.prefix_blocks:
            self.pool = empty_pool(c, self.staging.caches, s.prefix_blocks, s.chunk)

    def begin(self, seq: np.ndarray, *, stops: np.ndarray, length: int, limit: int, temperature: float, top_k: int,
              top_p: float, greedy: bool, seed: int):
        self._send(BEGIN, (length, limit, top_k, int(greedy), seed, _bits(temperature), _bits(top_p)),
                   np.concatenate([seq, stops.ravel()]))
        sampling = SamplingParams(jnp.float32([temperature]), jnp.int32([top_k]), jnp.float32([top_p]),
                                  jnp.array([greedy]))
        self.staging = stage_begin(self.s.static, self.staging, self.empty, jnp.asarray(seq, jnp.int32)[None],
                                   jnp.int32([length]), jnp.int32([limit]), jnp.asarray(stops, jnp.int32)[None],
                                   sampling, jax.random.key(seed)[None])

    def load(self, ids: np.ndarray, count: int):
        """Store entries ids[:count] as the staged caches' first chunks (ids: one per cache chunk),
        with the rings of the last (`load_blocks`)."""
        self._send(LOAD, (count,), ids)
        caches = load_blocks(self.s.static.config, self.staging.caches, self.pool, jnp.asarray(ids, jnp.int32),
                             jnp.int32(count))
        self.staging = self.staging.replace(caches=caches)

    def store(self, blocks: np.ndarray, entries: np.ndarray):
        """Staged chunks `blocks` into store `entries` (one per cache chunk; entries at or past the
        store's size are skipped). Each chunk's rings are taken as they are now, so the engine
        stores a chunk right after prefilling it (see the module's docstring); with nothing to
        copy, one copy the store drops runs (it compiles the program)."""
        self._send(STORE, (), np.concatenate([blocks, entries]))
        pairs = [(b, e) for b, e in zip(blocks, entries) if e < self.s.prefix_blocks] or [(0, self.s.prefix_blocks)]
        for block, entry in pairs:
            self.pool = store_block(self.s.static.config, self.s.chunk, self.pool, self.staging.caches,
                                    jnp.int32(block), jnp.int32(entry))

    def chunk(self, start: int, size: int, *, draft: bool = True):
        """The staged prompt's prefill over start..start + size - 1 (V4's prefill runs the MTP block
        once, at insertion, whatever `draft` says)."""
        self._send(CHUNK, (start, size, int(draft)))
        self.staging = stage_chunk(self.s.static, size, self.s.params, self.staging, jnp.int32(start))

    def insert(self, slot: int, *, staging=None) -> tuple[int, float, bool]:
        self._send(INSERT, (slot,))
        staging = self.staging if staging is None else staging
        self.state, self.params, first = insert(self.s.static, self.s.params, self.state, self.params, staging,
                                                jnp.int32(slot))
        token, logprob, done = _fetch(first)
        return int(token), float(logprob), bool(done)

    def _mode(self, greedy: bool) -> SamplingMode:
        return programs.GREEDY if greedy else programs.MIXED

    def segment(self, *, greedy: bool, bucket: int, k: int, rounds: int, refill: np.ndarray, early: bool,
                halt: np.ndarray) -> programs.Report:
        """A decode segment (`segment`; refill is not needed on V4, see the module's docstring)."""
        self._send(SEGMENT, (int(greedy), bucket, k, rounds, int(early)),
                   np.concatenate([halt, refill]).astype(np.int32))
        rows = programs.bucket_rows(halt, bucket)
        self.state, self.params, report = segment(
            self.s.static, self._mode(greedy), bucket, self.s.window, self.s.ks, self.s.params, self.state,
            self.params, jnp.int32(k), jnp.int32(rounds), jnp.asarray(halt), jnp.bool_(early), jnp.asarray(rows))
        return programs.by_slot(_fetch(report), rows, self.s.slots)

    def compile_segment(self, *, greedy: bool, bucket: int):
        halt = jnp.zeros((self.s.slots,), bool)
        segment.lower(self.s.static, self._mode(greedy), bucket, self.s.window, self.s.ks, self.s.params,
                      self.state, self.params, jnp.int32(self.s.ks[0]), jnp.int32(1), halt, jnp.bool_(False),
                      jnp.arange(bucket, dtype=jnp.int32)).compile()

    def occupy(self, rows: np.ndarray, position: int):
        self._send(OCCUPY, (position,), rows.astype(np.int32))
        self.state, self.params = occupy(self.s.static, self.state, self.params, jnp.asarray(rows),
                                         jnp.int32(position))

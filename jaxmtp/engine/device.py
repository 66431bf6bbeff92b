"""The serving engine's device side: the slots' state and the operations on it, in lockstep across
processes.

With several processes (jax.distributed, a mesh over their devices), one process takes requests
and schedules (process 0, the leader); every process must launch the same programs in the same
order, since each launches its part of their collectives. So the leader sends every operation
(its kind and its arguments, as one int32 vector of a fixed length) to the others with
`multihost_utils.broadcast_one_to_all` before it runs it, and the others (`Device.follow`) receive
and run the same operation; results that the host reads (a request's first token, a segment's
report) are gathered on every process alike. With one process nothing is sent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.decoding import Inputs, Static
from jaxmtp.engine import programs
from jaxmtp.generation import _fetch  # a collective where a mesh spans several processes: every process runs it
from jaxmtp.sampling import SamplingParams

FRESH, BEGIN, LOAD, CHUNK, INSERT, STORE, SEGMENT, OCCUPY, NOOP, STOP = range(10)
HEADER = 8


def _bits(value: float) -> int:
    return int(np.float32(value).view(np.int32))


def _float(bits) -> float:
    return float(np.int32(bits).view(np.float32))


@dataclasses.dataclass
class Settings:
    """What the device side is specialised on: static (the MIXED loop configuration), params (the
    model's), slots, chunk (prefill chunk and prefix block), window (report tokens), stops (N, L),
    prefix_blocks (0: no store), stagings (staging states: 2 where prefill runs on a thread of its
    own, which prefills the next request while the last waits to be inserted), ks (the k that
    segments run, each a loop of the segment programs)."""

    static: Static
    params: object
    slots: int
    chunk: int
    window: int
    stops: tuple[int, int]
    prefix_blocks: int
    stagings: int = 1
    ks: tuple[int, ...] = (0,)


class Device:
    """The slots' state, the staging state and the prefix store, and the operations the engine runs
    on them (see the module's docstring for several processes)."""

    def __init__(self, settings: Settings):
        self.s = settings
        self.leader = jax.process_index() == 0
        self.many = jax.process_count() > 1
        self.blocks = settings.static.cache_len // settings.chunk
        self.width = HEADER + max(self.s.static.cache_len + self.s.static.k + 1 + int(np.prod(self.s.stops)),
                                  2 * self.blocks, 2 * self.s.slots)

    # ----- lockstep -----

    def _send(self, op: int, header=(), payload=()):
        """The leader's operation to the other processes (nothing with one process)."""
        if not (self.many and self.leader):
            return
        message = np.zeros((self.width,), np.int32)
        message[0] = op
        message[1:1 + len(header)] = header
        message[HEADER:HEADER + len(payload)] = payload
        self._broadcast(message)

    def _broadcast(self, message: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(message))

    def follow(self):
        """Runs the leader's operations as they arrive, until it stops (another process only)."""
        if self.leader:
            raise RuntimeError("follow: process 0 leads; the other processes follow it")
        while True:
            m = self._broadcast(np.zeros((self.width,), np.int32))
            op, h, p = int(m[0]), m[1:HEADER], m[HEADER:]
            if op == STOP:
                return
            if op == FRESH:
                self.fresh()
            elif op == BEGIN:
                w = self.s.static.cache_len + self.s.static.k + 1
                self.begin(p[:w], stops=p[w:w + int(np.prod(self.s.stops))].reshape(self.s.stops), length=int(h[0]),
                           limit=int(h[1]), top_k=int(h[2]), greedy=bool(h[3]), seed=int(h[4]),
                           temperature=_float(h[5]), top_p=_float(h[6]))
            elif op == LOAD:
                self.load(p[:self.blocks], int(h[0]))
            elif op == CHUNK:
                self.chunk(int(h[0]), int(h[1]), draft=bool(h[2]))
            elif op == INSERT:
                self.insert(int(h[0]))
            elif op == STORE:
                self.store(p[:self.blocks], p[self.blocks:2 * self.blocks])
            elif op == SEGMENT:
                self.segment(greedy=bool(h[0]), bucket=int(h[1]), k=int(h[2]), rounds=int(h[3]),
                             refill=p[self.s.slots:2 * self.s.slots].astype(bool), early=bool(h[4]),
                             halt=p[:self.s.slots].astype(bool))
            elif op == OCCUPY:
                self.occupy(p[:self.s.slots].astype(bool), int(h[0]))

    def stop(self):
        """Ends the other processes' `follow`."""
        self._send(STOP)

    def noop(self):
        """Keeps the other processes' waiting collective alive while the leader is idle."""
        self._send(NOOP)

    # ----- operations -----

    def fresh(self):
        """Every slot free, an empty staging state and prefix store."""
        self._send(FRESH)
        s = self.s
        self.state = programs.empty_slots(s.static, s.slots)
        self.params = jax.tree.map(jnp.asarray, programs.empty_slot_params(s.slots, s.stops))
        self.staging = programs.empty_staging(s.static, s.stops)
        self.spares = [programs.empty_staging(s.static, s.stops) for _ in range(s.stagings - 1)]
        self.pool = None
        if s.prefix_blocks:
            def pool(leaf):
                return jnp.zeros(leaf.shape[:-3] + (s.prefix_blocks, s.chunk, leaf.shape[-1]), leaf.dtype)

            self.pool = jax.tree.map(pool, self._cached())

    def _cached(self) -> dict:
        """The staging caches the prefix store copies: the main stacks' and the MTP layer's."""
        carry = self.staging.carry
        return {"main": carry.caches, "mtp": None if carry.drafts is None else carry.drafts.cache}

    def begin(self, seq: np.ndarray, *, stops: np.ndarray, length: int, limit: int, temperature: float, top_k: int,
              top_p: float, greedy: bool, seed: int):
        """A request into the staging state: seq [W] its prompt (zeros after), stops [N, L]."""
        self._send(BEGIN, (length, limit, top_k, int(greedy), seed, _bits(temperature), _bits(top_p)),
                   np.concatenate([seq, stops.ravel()]))
        sampling = SamplingParams(np.float32([temperature]), np.int32([top_k]), np.float32([top_p]), np.array([greedy]))
        inputs = Inputs(prompt=None, lengths=np.int32([length]), limits=np.int32([limit]), real=np.ones((1,), bool),
                        stops=np.asarray(stops, np.int32)[None], sampling=sampling, key=jax.random.key(seed),
                        costs=None, force_k=None)
        self.staging = programs.stage_begin(self.s.static, self.staging, np.asarray(seq, np.int32)[None], inputs)

    def load(self, ids: np.ndarray, count: int):
        """Store entries ids[:count] into the staged caches' first chunks (ids: one per cache chunk)."""
        self._send(LOAD, (count,), ids)
        cached = programs.load_blocks(self._cached(), self.pool, np.asarray(ids, np.int32), np.int32(count))
        carry = self.staging.carry
        drafts = None if carry.drafts is None else carry.drafts.replace(cache=cached["mtp"])
        self.staging = self.staging.replace(carry=carry.replace(caches=cached["main"], drafts=drafts))

    def chunk(self, start: int, size: int, *, draft: bool = True):
        """The staged prompt's prefill over positions start..start + size - 1 (size: the prefill
        chunk, or a smaller one for a prompt's last positions; start + the prefill chunk must fit
        the cache, as it does where start is a multiple of it); the MTP pass too with `draft`."""
        self._send(CHUNK, (start, size, int(draft)))
        self.staging = programs.stage_chunk(self.s.static, size, draft, self.s.params, self.staging,
                                            np.int32(start))

    def insert(self, slot: int, *, staging=None) -> tuple[int, float, bool]:
        """The staged request (or one handed over, `staging`) into `slot` -> (its first token,
        that token's log-probability, done)."""
        self._send(INSERT, (slot,))
        staging = self.staging if staging is None else staging
        self.state, self.params, first = programs.insert(self.s.static, self.state, self.params, staging,
                                                         np.int32(slot))
        token, logprob, done = _fetch(first)
        return int(token), float(logprob), bool(done)

    def hand_over(self):
        """The staging state, prefilled, for a later insert(staging=...); a spare one takes its
        place (None where there is none until take_back)."""
        done, self.staging = self.staging, self.spares.pop() if self.spares else None
        return done

    def take_back(self, staging):
        """A staging state handed over and inserted, free for the next request."""
        if self.staging is None:
            self.staging = staging
        else:
            self.spares.append(staging)

    def store(self, blocks: np.ndarray, entries: np.ndarray):
        """Staged cache chunks `blocks` into store `entries` (both one per cache chunk; entries at
        or past the store's size are skipped)."""
        self._send(STORE, (), np.concatenate([blocks, entries]))
        self.pool = programs.store_blocks(self.pool, self._cached(), np.asarray(blocks, np.int32),
                                          np.asarray(entries, np.int32))

    def segment(self, *, greedy: bool, bucket: int, k: int, rounds: int, refill: np.ndarray, early: bool,
                halt: np.ndarray) -> programs.Report:
        """A decode segment (programs.segment; refill and halt [slots] bool) -> its report as numpy arrays."""
        self._send(SEGMENT, (int(greedy), bucket, k, rounds, int(early)),
                   np.concatenate([halt, refill]).astype(np.int32))
        static = dataclasses.replace(self.s.static, mode=programs.GREEDY) if greedy else self.s.static
        rows = programs.bucket_rows(halt, bucket)
        state, ks, refills, drafts = self._segment_state(k)
        state, self.params, report = programs.segment(
            static, bucket, self.s.window, ks, refills, self.s.params, state, self.params, np.int32(k),
            np.int32(rounds), np.asarray(refill, bool), np.asarray(halt, bool), np.bool_(early),
            np.asarray(rows, np.int32))
        self.state = state if drafts is None else state.replace(drafts=drafts)
        return programs.by_slot(_fetch(report), rows, self.s.slots)

    def _segment_state(self, k: int):
        """The state a segment at k runs on, the loops its program holds, whether it refills, and
        the MTP state it leaves out (or None). An auto engine (ks holds 0 and a k > 0) runs two
        programs: at k = 0 one of plain rounds on the state without its MTP state (rounds at k = 0
        leave that state as it is, and a program that carries it gathers and scatters it, and runs
        the drafting loops' and the refill's entries, in every segment: benchmarks/serving.py at
        concurrency 1, where auto decodes plainly), and at k > 0 one of the drafting loops and
        the refill."""
        ks = self.s.ks
        if self.state.drafts is None or ks[0] != 0 or len(ks) == 1:
            return self.state, ks, False, None
        if k == 0:
            return self.state.replace(drafts=None), (0,), False, self.state.drafts
        return self.state, ks[1:], True, None

    def compile_segment(self, *, greedy: bool, bucket: int):
        """Compiles the segment programs of this mode and bucket ahead of their first call (JAX's
        persistent cache then holds them for that call); safe to run in threads side by side."""
        static = dataclasses.replace(self.s.static, mode=programs.GREEDY) if greedy else self.s.static
        halt = jnp.zeros((self.s.slots,), bool)
        for k in sorted({self.s.ks[0], self.s.ks[-1]}):  # auto's two programs (_segment_state)
            state, ks, refills, _ = self._segment_state(k)
            programs.segment.lower(static, bucket, self.s.window, ks, refills, self.s.params, state, self.params,
                                   jnp.int32(k), jnp.int32(1), halt, halt, jnp.bool_(False),
                                   jnp.arange(bucket, dtype=jnp.int32)).compile()

    def occupy(self, rows: np.ndarray, position: int):
        """Calibration: the rows set in rows [slots] (bool) run from `position` without limit
        (programs.occupy)."""
        self._send(OCCUPY, (position,), rows.astype(np.int32))
        self.state, self.params = programs.occupy(self.s.static, self.state, self.params, np.asarray(rows, bool),
                                                  np.int32(position))

    def ready(self, *, decode: bool = True, staging: bool = True):
        """Waits for the operations sent so far on the slots (decode) and on the staging state to
        finish (for timing)."""
        jax.block_until_ready(((self.state, self.params) if decode else (), self.staging if staging else ()))

"""`Engine`: continuous batching with MTP speculation, on one thread of its own.

Made once from a loaded model, an engine compiles its programs and measures what a round costs at
each k for each batch bucket (`start`); later calls only run them. Requests wait in a queue, are
admitted into free slots (the lowest first), and are prefilled a chunk at a time: on a CPU with
one process, on a thread of their own beside the decode segments (a decode step's small kernels
leave a core mostly idle; two staging states let the next prompt be prefilled while the last waits
for its slot), elsewhere between segments, so that a long prompt delays the running requests by a
chunk per segment rather than by its whole prefill (EngineConfig.concurrent_prefill). Each segment
runs a bounded number of rounds on the live rows at one k, in the smallest batch bucket that holds
them unless a larger one is calibrated cheaper by BUCKET_MARGIN (a bucket smaller than every slot
gathers its rows from their slots, so that the last rows of a burst do not run at the full batch's
cost: benchmarks/engine_profile.py),
and returns early when a row finishes while requests wait for a slot.

k is chosen per segment (`Chooser`): the expected tokens per round of every live row at each k
(from its own acceptance by draft position, with the engine's pooled acceptance as its prior) over
the measured cost of a round at that k for the bucket that runs. A new k replaces the last only
when it pays at least `hysteresis` more, so that k does not flip at a boundary. Every round is
an exact verification whatever its k: greedy rows equal their plain greedy decoding, sampled rows
follow the model's distribution (jaxmtp.speculative).

Prefix reuse: after a prompt's prefill its whole chunks of cache entries are copied into a store
keyed by the tokens they depend on (the chunk's tokens and everything before, and the token after
it, which the MTP layer's entry at the chunk's last position reads); a later prompt that starts
with the same tokens copies them back instead of running them.

A DeepSeek-V4 model runs on the same engine with its own device side (jaxmtp.engine.v4), whose
prefix store keeps each chunk's compressed entries and ring buffers as the chunk is prefilled.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxmtp import adaptive, checks, compile_cache, streaming
from jaxmtp.decoding import ANY, AUTO_SEGMENT, NEVER, Static
from jaxmtp.engine import device, programs
from jaxmtp.engine.requests import Event, Handle, NotAdmitting, QueueFull, Request
from jaxmtp.errors import InputError
from jaxmtp.generation import MAX_SPECULATIVE_K, _v4, auto_max_k
from jaxmtp.layout import prefix_lengths
from jaxmtp.model import Model

TIMED_REPEATS = 3  # timed segments per (mode, bucket, position, k) at start
# A bucket larger than the smallest that holds a segment's rows runs it only where calibrated this
# much cheaper: near the start of the cache the buckets' costs tie, and two engines' calibrations
# put bucket 64 12% below bucket 32 and 5% above it (benchmarks/engine_ab.py at concurrency 64).
BUCKET_MARGIN = 0.1
IDLE_SECONDS = 5.0  # an idle engine's heartbeat to the other processes
# While a prompt is being prefilled, a segment runs up to this many times segment_rounds rounds, so
# that a prefill chunk that takes longer than prefill_share of a segment is spread over more rounds.
PREFILL_SPREAD = 4
BUSY_DECAY = 0.95  # per segment, of the recent prefill and decode seconds that _prefill_overhead weighs
# After this many rounds at k = 0 in a row, auto runs one segment at its best k > 0, to measure the
# acceptance again (see Engine._explore); each such segment after which auto still decodes plainly
# doubles the wait, up to EXPLORE_ROUNDS_MOST, and auto choosing a k > 0 of itself restores it.
EXPLORE_ROUNDS = 1024
EXPLORE_ROUNDS_MOST = 4096
# The weight, in rounds, of the engine's pooled acceptance as a request's prior (Chooser.expected),
# and the decay of the pooled counts per row-round drafted: the pooled estimate follows the last
# thousand or so row-rounds, and a request's own counts outweigh it only after tens of rounds. With
# generate's values (adaptive.PRIOR_ROUNDS, adaptive.DECAY), the pooled estimate followed the last
# hundred row-rounds, which were those of the requests auto drafted for because their first rounds
# accepted more: it read 0.7 where the demo's text accepts 0.55, and every new request began
# drafting where plain decoding was faster (benchmarks/serving.py at concurrency 1).
SLOT_PRIOR_ROUNDS = 64.0
POOLED_DECAY = 0.999


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """slots: rows decoded at once. max_len: prompt plus new tokens of a request, at most.
    speculative_k: "auto" (chosen per segment from costs and acceptance, up to auto_max_k) or a
    fixed k (0 = plain decoding). prefill_chunk: prompt positions prefilled per step between
    segments, and the prefix store's block. segment_rounds: rounds per segment, at most.
    buckets: the batch sizes compiled (default powers of two up to slots). prefix_blocks: chunks
    the prefix store holds (0: no reuse). max_queue: requests waiting, at most (more are refused
    with QueueFull). sampling: compile the sampling programs (else only greedy requests are taken).
    stop_sequences, stop_length: the per-request stop table (EOS ids included). hysteresis: how
    much more a new k must pay to replace the last. draft_margin: how much more a drafting k must
    be predicted to pay than plain decoding (see Engine._decode). prefill_share: prefill time
    between two segments, at most, as a share of a segment's time, per request waiting (at least
    one chunk runs): the running requests' inter-token latency grows by about this share while one
    prompt is prefilled (benchmarks/engine_latency.py), and by more while several wait."""

    slots: int = 16
    max_len: int = 1024
    speculative_k: int | str = "auto"
    prefill_chunk: int = 128
    segment_rounds: int = 8
    buckets: tuple[int, ...] | None = None
    prefix_blocks: int = 64
    max_queue: int = 256
    sampling: bool = True
    stop_sequences: int = 8
    stop_length: int = 8
    hysteresis: float = 0.05
    draft_margin: float = 0.1
    prefill_share: float = 0.5
    concurrent_prefill: bool | None = None

    def bucket_sizes(self) -> tuple[int, ...]:
        if self.buckets is not None:
            return tuple(sorted(set(self.buckets)))
        sizes = [1 << i for i in range(self.slots.bit_length()) if 1 << i < self.slots]
        return tuple(sizes + [self.slots])


def _concurrent_prefill(wanted: bool | None, model: Model) -> bool:
    """EngineConfig.concurrent_prefill resolved for this process and model's mesh."""
    devices = 1 if model.mesh is None else model.mesh.devices.size
    alone = jax.process_count() == 1 and devices == 1
    if wanted is None:
        return alone and jax.default_backend() == "cpu"
    if wanted and not alone:
        raise InputError(f"concurrent_prefill: needs one process on one device, found {jax.process_count()} "
                         f"process(es) and a mesh of {devices} device(s) (other processes replay the leader's "
                         "operations in one order, and two sharded programs at once would share their devices)")
    return bool(wanted)


def _check_config(c: EngineConfig, model: Model) -> EngineConfig:
    checks.whole("slots", c.slots, minimum=1)
    checks.whole("max_len", c.max_len, minimum=2, maximum=model.config.max_position_embeddings)
    checks.whole("prefill_chunk", c.prefill_chunk, minimum=16)
    if c.prefill_chunk % 16:
        raise InputError(f"prefill_chunk: expected a multiple of 16, found {c.prefill_chunk}")
    checks.whole("segment_rounds", c.segment_rounds, minimum=1)
    checks.whole("prefix_blocks", c.prefix_blocks, minimum=0)
    checks.whole("max_queue", c.max_queue, minimum=0)
    checks.whole("stop_sequences", c.stop_sequences, minimum=1)
    checks.whole("stop_length", c.stop_length, minimum=1)
    checks.real("hysteresis", c.hysteresis, minimum=0)
    checks.real("draft_margin", c.draft_margin, minimum=0)
    checks.real("prefill_share", c.prefill_share, minimum=0, above_minimum=True)
    k = c.speculative_k
    if k != "auto":
        if isinstance(k, str):
            raise InputError(f'speculative_k: expected "auto" or an integer 0..{MAX_SPECULATIVE_K}, found {k!r}')
        checks.whole("speculative_k", k, minimum=0, maximum=MAX_SPECULATIVE_K)
        if k and not model.config.has_mtp:
            raise InputError("speculative_k > 0 needs an MTP module; this model has num_nextn_predict_layers = 0")
    buckets = c.bucket_sizes()
    if not buckets or buckets[-1] != c.slots or buckets[0] < 1:
        raise InputError(f"buckets: expected batch sizes 1..slots ending at slots = {c.slots}, found {list(buckets)}")
    return c


class Chooser:
    """The k of each segment: argmax over k of (expected tokens per round, summed over the live
    rows) / (seconds per round at k for the bucket), kept unless a new k pays `hysteresis` more.

    Acceptance per draft position is counted per slot (reset when a request takes the slot) and
    for the engine (pooled over every request since start); a slot's posterior takes the pooled
    estimate as its prior (SLOT_PRIOR_ROUNDS rounds' weight), so that what the engine has learned
    carries over to new requests and to the next segment instead of restarting from the fixed
    prior. A slot's counts decay by adaptive.DECAY per round drafted, the pooled counts by
    POOLED_DECAY per row-round; rounds at k = 0 measure nothing and leave them as they are (the
    engine explores instead: Engine._explore)."""

    def __init__(self, k_max: int, slots: int, hysteresis: float):
        self.k_max, self.hysteresis = k_max, hysteresis
        self.tried = np.zeros((slots, k_max))
        self.accepted = np.zeros((slots, k_max))
        self.pooled_tried = np.zeros(k_max)
        self.pooled_accepted = np.zeros(k_max)
        self.k = None
        # expected()'s answers by rows, until a count changes (record, reset): rounds at k = 0 change
        # none, so that a segment of plain rounds reads its rows' answer instead of working it out
        self._expected: dict[tuple[int, ...], tuple[float, ...]] = {}

    def reset(self, slot: int):
        self.tried[slot] = self.accepted[slot] = 0
        self._expected.clear()

    def pooled(self) -> np.ndarray:
        """The engine's conditional acceptance by draft position [k_max] (the fixed prior blended in)."""
        prior = adaptive.PRIOR_ACCEPTANCE * adaptive.PRIOR_ROUNDS
        return (self.pooled_accepted + prior) / (self.pooled_tried + adaptive.PRIOR_ROUNDS)

    def expected(self, rows: Sequence[int]) -> tuple[float, ...]:
        """Expected tokens per round at k = 0..k_max, summed over `rows` [k_max + 1]."""
        rows = tuple(rows)
        kept = self._expected.get(rows)
        if kept is None:
            prior, at = self.pooled() * SLOT_PRIOR_ROUNDS, list(rows)
            conditional = (self.accepted[at] + prior) / (self.tried[at] + SLOT_PRIOR_ROUNDS)
            reach = np.cumprod(conditional, axis=1)  # [r, k_max]
            tokens = (1.0 + np.concatenate([np.zeros((len(rows), 1)), np.cumsum(reach, axis=1)], axis=1)).sum(axis=0)
            kept = self._expected[rows] = tuple(tokens.tolist())
        return kept

    def choose(self, rate: Sequence[float]) -> int:
        """The k for a segment whose rows' expected tokens per second at each k are `rate`
        [k_max + 1] (expected(rows) over the seconds per round)."""
        best = max(range(len(rate)), key=rate.__getitem__)  # the first of equals, as np.argmax
        if self.k is None or self.k > self.k_max or rate[best] > rate[self.k] * (1 + self.hysteresis):
            self.k = best
        return self.k

    def record(self, slot: int, k: int, rounds: int, accepted_at: np.ndarray):
        """A slot's segment: `rounds` rounds at k, accepted_at [k_max] the rounds in which draft i
        was accepted."""
        if not k or not rounds:
            return
        tried = np.zeros(self.k_max)
        tried[0] = rounds
        tried[1:k] = accepted_at[:k - 1]
        hit = np.zeros(self.k_max)
        hit[:k] = accepted_at[:k]
        decay = adaptive.DECAY ** rounds
        self.tried[slot] = decay * self.tried[slot] + tried
        self.accepted[slot] = decay * self.accepted[slot] + hit
        pooled = POOLED_DECAY ** rounds
        self.pooled_tried = pooled * self.pooled_tried + tried
        self.pooled_accepted = pooled * self.pooled_accepted + hit
        self._expected.clear()


@dataclasses.dataclass
class _Running:
    """A request in a slot: what has been delivered, its counts as last read, its stop strings."""

    handle: Handle
    prompt_len: int
    greedy: bool
    delivered: int = 0
    rounds: int = 0
    accepted_at: np.ndarray | None = None
    receiver: streaming.Receiver | None = None
    cached: int = 0


@dataclasses.dataclass
class _Staged:
    """The request being prefilled: its slot, the next chunk's start, its last prompt position."""

    handle: Handle
    slot: int
    start: int
    last: int
    cached: int
    drafted: bool = True  # whether its last chunk ran the MTP pass
    prefilled: bool = False  # (concurrent_prefill) its chunks have run, or stopped at a cancellation
    seconds: float = 0.0  # (concurrent_prefill) the time its chunks took
    due: float = 0.0  # (concurrent_prefill) when its last chunk is expected to end (time.perf_counter)
    buffer: object = None  # (concurrent_prefill) its staging state, handed over once prefilled


class PrefixStore:
    """Host index of the prefix store: chunk keys -> store entries, least recently used evicted.
    A chunk's key digests every prompt token up to the chunk's end and `lookahead` more: the V3
    family's MTP entry at a chunk's last position reads the token after it (1); V4's MTP cache is
    not stored (0)."""

    def __init__(self, entries: int, block: int, lookahead: int = 1):
        self.entries, self.block, self.lookahead = entries, block, lookahead
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.free = list(range(entries))

    def keys(self, prompt: Sequence[int], blocks: int) -> list[bytes]:
        tokens = np.asarray(prompt, np.int32)
        return [hashlib.sha256(tokens[:(j + 1) * self.block + self.lookahead].tobytes()).digest()
                for j in range(blocks)]

    def _leading(self, prompt: Sequence[int], most: int) -> list[bytes]:
        """The keys of the prompt's leading chunks that are stored, at most `most`; dictionary
        reads only, so that another thread may ask (jaxmtp.engine.Replicas)."""
        found = []
        for key in self.keys(prompt, most):
            if key not in self.index:
                break
            found.append(key)
        return found

    def held(self, prompt: Sequence[int], most: int) -> int:
        """How many of the prompt's leading chunks (at most `most`) are stored, none marked as used."""
        return len(self._leading(prompt, most))

    def match(self, prompt: Sequence[int], most: int) -> list[int]:
        """The store entries of the prompt's leading chunks, at most `most` of them (marked as used)."""
        found = self._leading(prompt, most)
        for key in found:
            self.index.move_to_end(key)
        return [self.index[key] for key in found]

    def _entry(self, key: bytes) -> int | None:
        """A store entry for a chunk key that is not stored yet, the least recently used evicted
        where none is free; None for a stored key (marked as just used)."""
        if key in self.index:
            self.index.move_to_end(key)
            return None
        if not self.free:
            self.free.append(self.index.popitem(last=False)[1])
        entry = self.free.pop()
        self.index[key] = entry
        return entry

    def place_one(self, prompt: Sequence[int], block: int) -> int | None:
        """An entry for the prompt's chunk `block` where it is not stored yet, else None."""
        return self._entry(self.keys(prompt, block + 1)[block])

    def place(self, prompt: Sequence[int], blocks: int) -> tuple[list[int], list[int]]:
        """Entries for the prompt's first `blocks` chunks that are not stored yet -> (chunk numbers,
        entries); evicts the least recently used."""
        placed = [(j, self._entry(key)) for j, key in enumerate(self.keys(prompt, blocks))]
        placed = [(j, entry) for j, entry in placed if entry is not None]
        return [j for j, _ in placed], [entry for _, entry in placed]


class Engine:
    """Continuous batching with MTP speculation for one model (see the module's docstring).

    engine = Engine(model, tokenizer=tok, slots=16, max_len=1024); engine.start() compiles and
    calibrates, then decodes on a thread of its own. submit(request, on_event) queues a request;
    generate(prompts, ...) submits several and waits for them. shutdown() stops it."""

    def __init__(self, model: Model, *, tokenizer=None, eos_token_id=None, progress: Callable[[str], None] | None = None,
                 config: EngineConfig | None = None, **options):
        config = dataclasses.replace(config or EngineConfig(), **options)
        self.config = _check_config(config, model)
        self.concurrent = _concurrent_prefill(self.config.concurrent_prefill, model)
        v4 = self._v4 = _v4(model)
        rates = sorted({model.config.compress_rate(kind) for kind in model.config.layer_types} - {0}) if v4 else []
        if self.config.prefix_blocks and any(self.config.prefill_chunk % rate for rate in rates):
            raise InputError(f"prefill_chunk: prefix reuse on this DeepSeek-V4 model stores chunks of whole compressed "
                             f"entries, so the chunk must be a multiple of its compression rates {rates}, found "
                             f"{self.config.prefill_chunk} (or prefix_blocks=0)")
        # Positions a prompt leaves to its prefill after a reused prefix: auto's window of main hidden
        # states (V3), or the MTP block's sliding window over the prompt's last positions (V4).
        self._prefill_tail = max(AUTO_SEGMENT, model.config.sliding_window) if v4 else AUTO_SEGMENT
        compile_cache.enable()
        self.model = model if v4 else model.decoding()
        self.tokenizer = tokenizer
        self.eos_token_ids = checks.eos_ids(eos_token_id, model.config.vocab_size)
        self._progress = progress or (lambda message: None)
        c = self.config
        k = c.speculative_k
        self.k_max = (auto_max_k(self.model) if model.config.has_mtp else 0) if k == "auto" else int(k)
        self.auto = k == "auto" and self.k_max > 0
        # The k that segments run: every k up to the largest with auto, else the fixed k alone
        # (a loop of the segment programs each, compiled and calibrated at start).
        self.ks = tuple(range(self.k_max + 1)) if self.auto else (self.k_max,)
        chunk = c.prefill_chunk
        cache_len = -(-(c.max_len + self.k_max + 1) // chunk) * chunk
        if v4:
            from jaxmtp.engine.v4 import V4Static

            self.static = V4Static(model.config, self.model.dtype, self.k_max, cache_len)
        else:
            self.static = Static(model.config, self.model.dtype, self.k_max, programs.MIXED, cache_len,
                                 self.model.layout, auto=True, logprobs=True, prefill_chunk=chunk)
        self.buckets = c.bucket_sizes()
        # The cache prefixes a round can attend over (see _attended).
        prefixed = not v4 and self.model.layout.prefix_attention
        self._prefixes = tuple(int(n) for n in (prefix_lengths(cache_len) if prefixed else (cache_len,)))
        # A prompt's last positions run in a chunk of a half or a quarter of prefill_chunk where
        # they fit one (multiples of 16), instead of a whole chunk of padding.
        self.chunk_sizes = tuple(size for size in (chunk // 4, chunk // 2, chunk) if size >= 16 and size % 16 == 0)
        self.max_rounds = c.segment_rounds * PREFILL_SPREAD
        self.window = self.max_rounds * (self.k_max + 1) + 1
        self.chunk_seconds = 0.0  # a prefill chunk's time, measured at start
        self.draft_share = 0.0  # the share of that time that the MTP pass takes
        self._forced: int | None = None
        self.max_len, self.slots = c.max_len, c.slots
        # mode -> bucket -> seconds per round [calibration positions, k]; the cache positions their rounds attended
        self.costs: dict[str, dict[int, np.ndarray]] = {}
        self.cost_reach = np.zeros(0, np.int64)
        # (mode, bucket, positions attended at each k) -> round_costs' answer, which every segment
        # asks for each bucket: interpolated afresh, it made auto's bookkeeping at k = 0 cost
        # several times a plain engine's, a few percent of the demo's segments at one row
        # (benchmarks/engine_ab.py at concurrency 1).
        self._cost_memo: dict[tuple, np.ndarray] = {}
        self._chooser = Chooser(max(self.k_max, 1), c.slots, c.hysteresis)
        self._prefix = PrefixStore(c.prefix_blocks, chunk, lookahead=0 if v4 else 1) if c.prefix_blocks else None
        settings = device.Settings(static=self.static, params=self.model.params, slots=c.slots, chunk=chunk,
                                   window=self.window, stops=(c.stop_sequences, c.stop_length),
                                   prefix_blocks=c.prefix_blocks, stagings=2 if self.concurrent else 1, ks=self.ks)
        if v4:
            from jaxmtp.engine.v4 import V4Device

            self._device = V4Device(settings, self.model)
        else:
            self._device = device.Device(settings)
        self._lock = threading.Condition()
        self._inbox: collections.deque[Handle] = collections.deque()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._running: list[_Running | None] = [None] * c.slots
        self._staged: _Staged | None = None
        self._admitting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        # concurrent_prefill: the prefill thread, the signal that hands it the staged request, and
        # what ended it where it failed
        self._prefiller: threading.Thread | None = None
        self._prefilled: collections.deque[_Staged] = collections.deque()  # handed over, waiting for their slots
        self._prefill_error: BaseException | None = None
        self._chunk_times: dict[int, float] = {}  # the last chunk's seconds, by size (prefill thread)
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        self._segment_k = 0
        self._plain_rounds = 0  # auto's rounds at k = 0 since its last segment at k > 0 (_explore)
        self._explore_after = EXPLORE_ROUNDS  # the rounds at k = 0 before the next exploring segment
        # Slots whose drafts are stale: their last segment ran at k = 0, or their prefill skipped
        # the MTP pass; a segment at k > 0 refills them first.
        self._stale = np.zeros((c.slots,), bool)
        self._busy = {"prefill": 0.0, "decode": 0.0}  # recent seconds of each, decaying (see _prefill_overhead)
        self._segment_seconds = 1.0  # the last segment's time, per segment_rounds rounds
        self._chunk_seconds = 0.0  # the last prefill chunk's time
        self._last_rounds = c.segment_rounds
        self.counters = {"prompt_tokens_total": 0, "cached_prompt_tokens_total": 0, "generation_tokens_total": 0,
                         "drafted_total": 0, "accepted_total": 0, "segments_total": 0}
        self.rounds_by_k = collections.Counter()
        self.segments_by_bucket = collections.Counter()  # decode segments by the batch bucket they ran in
        self.finished = collections.Counter()
        self.failed: str | None = None  # why the engine's thread ended, if an error ended it

    # ----- setting up -----

    def start(self, *, calibrated_by: "Engine | None" = None) -> "Engine":
        """Compiles every program, measures a round's cost at each k for each bucket, then starts
        decoding on the engine's thread. -> self. calibrated_by: a started engine of the same model
        and config whose measured costs this one takes instead of measuring its own (Replicas). With several processes,
        process 0 takes the requests and the others' start() runs process 0's operations as they
        come (jaxmtp.engine.device) until process 0 shuts down."""
        if self._thread is not None:
            raise InputError("start: this engine has started already")
        if calibrated_by is not None and (calibrated_by.model is not self.model or calibrated_by.config != self.config
                                          or not calibrated_by.costs):
            raise InputError("start: calibrated_by must be a started engine of the same model and config")
        with self.model.mesh_context():
            if not self._device.leader:
                self._device.follow()
                return self
            self._device.fresh()
            self._calibrate(calibrated_by)
            self._device.fresh()
        self._admitting = True
        if self.concurrent:
            self._prefiller = threading.Thread(target=self._prefill_loop, name="jaxmtp-prefill", daemon=True)
            self._prefiller.start()
        self._thread = threading.Thread(target=self._run, name="jaxmtp-engine", daemon=True)
        self._thread.start()
        return self

    def modes(self) -> tuple[str, ...]:
        return ("greedy", "mixed") if self.config.sampling else ("greedy",)

    def _calibrate(self, source: "Engine | None" = None):
        """Runs a staged request through every program (compiling them), then times segments of
        every bucket's rows at each k from each of `_calibration_positions` (interleaved,
        TIMED_REPEATS each; the median), or takes `source`'s times."""
        self._progress(f"compiling the serving programs ({len(self.modes())} modes x {len(self.buckets)} batch buckets, "
                       f"k = {', '.join(map(str, self.ks))})")
        began = time.perf_counter()
        device = self._device
        self._compile_ahead()
        # A prompt of seeded random ids, for the chunks to be timed routing as text does (see
        # programs.calibration_tokens).
        length = min(self.config.prefill_chunk + 1, self.max_len - 1)
        prompt = np.random.default_rng(programs.CALIBRATION_SEED).integers(self.model.config.vocab_size, size=length)
        request = Request(prompt=tuple(map(int, prompt)), max_tokens=1)
        handle = Handle(request, lambda event: None, -1)
        self._begin(_Staged(handle, 0, 0, len(request.prompt) - 1, 0))
        while self._staged is not None:
            self._stage_step()
        if self._prefix is not None:  # both copies once, with nothing to copy
            self._store_blocks([], [])
            device.load(np.zeros((device.blocks,), np.int32), 0)
        drafts = (True, False) if self.auto else (self.k_max > 0,)  # the chunks' MTP pass, as _drafting chooses it
        for size in self.chunk_sizes:  # each chunk program compiled
            for draft in drafts:
                device.chunk(0, size, draft=draft)
        if source is not None:
            self._take_calibration(source)
            return
        chunk_times = {draft: [] for draft in drafts}
        for _ in range(TIMED_REPEATS):
            for draft in drafts:
                device.ready()
                began_chunk = time.perf_counter()
                device.chunk(0, self.config.prefill_chunk, draft=draft)
                device.ready()
                chunk_times[draft].append(time.perf_counter() - began_chunk)
        self.chunk_seconds = statistics.median(chunk_times[drafts[0]])
        if self.auto:  # the MTP pass's share of a prefill chunk
            self.draft_share = max(0.0, 1.0 - statistics.median(chunk_times[False]) / self.chunk_seconds)
        ks = self.ks
        positions = self._calibration_positions()
        times = {(m, b, p, k): [] for m in self.modes() for b in self.buckets for p in positions for k in ks}
        for repeat in range(TIMED_REPEATS + 1):
            if repeat == 1:
                self._progress(f"compiled in {time.perf_counter() - began:.1f} s; measuring a round's cost at each k "
                               f"for each batch bucket, from positions {', '.join(map(str, positions))}")
            for (mode, bucket, position, k), seconds in times.items():
                rows = np.arange(self.slots) < bucket
                device.occupy(rows, position)
                device.ready()
                began_segment = time.perf_counter()
                device.segment(greedy=mode == "greedy", bucket=bucket, k=k, rounds=self.config.segment_rounds,
                               refill=np.zeros_like(rows), early=False, halt=~rows)
                if repeat:  # the first pass compiles
                    seconds.append((time.perf_counter() - began_segment) / self.config.segment_rounds)
        self.cost_reach = np.array([self._attended(p + self.config.segment_rounds * (self.k_max + 1)) for p in positions])
        for mode in self.modes():
            self.costs[mode] = {b: np.array([[statistics.median(times[mode, b, p, k]) for k in ks] for p in positions])
                                for b in self.buckets}
        self._cost_memo.clear()
        self._segment_seconds = self.config.segment_rounds * float(self.costs["greedy"][self.buckets[0]][0, 0])
        self._progress(f"a prefill chunk of {self.config.prefill_chunk} positions: {1e3 * self.chunk_seconds:.2f} ms; "
                       f"round costs (ms per round at k = {', '.join(map(str, ks))}): " + "; ".join(
            f"{m} batch {b} from {p}: " + " ".join(f"{1e3 * s:.2f}" for s in self.costs[m][b][i])
            for m in self.modes() for b in self.buckets for i, p in enumerate(positions)))

    def _take_calibration(self, source: "Engine"):
        """`source`'s measured costs."""
        self.costs, self.cost_reach = source.costs, source.cost_reach
        self._cost_memo.clear()
        self.chunk_seconds, self.draft_share = source.chunk_seconds, source.draft_share
        self._segment_seconds = source._segment_seconds
        self._progress("round costs taken from the engine that measured them")

    def _attended(self, position: int) -> int:
        """Cache positions a round attends over when its furthest row is at `position`: the
        shortest prefix holding it with layout.prefix_attention, else the whole cache."""
        lengths = self._prefixes
        return lengths[min(bisect.bisect_right(lengths, position), len(lengths) - 1)]

    def _calibration_positions(self) -> tuple[int, ...]:
        """Where calibration's rows start: early in the shortest attended prefix and, where the costs
        choose something (auto's k, or the bucket among several) and rounds can attend over a
        longer prefix, late enough that they attend over the whole cache. Near the start a round's
        cost hardly grows with its rows, so that early costs alone could put a plain engine's few
        rows in the slots' bucket, where attention over longer caches cost it 15-20% of its tokens
        per second against the smallest bucket that held them (benchmarks/engine_ab.py at
        concurrency 64 on 64 slots: segments_by_bucket beside the tokens per second)."""
        advance = self.config.segment_rounds * (self.k_max + 1)
        early = min(self.max_len // 4, max(self._attended(0) - advance - 1, 0))
        late = self.max_len - advance - 1
        read = self.auto or len(self.buckets) > 1
        if not read or late <= early or self._attended(late) == self._attended(early + advance):
            return (early,)
        return (early, late)

    def round_costs(self, mode: str, bucket: int, furthest: int) -> np.ndarray:
        """Seconds per round at each k of self.ks [len(ks)] for `bucket` rows whose furthest is at
        position `furthest` (a segment's rounds attend over more of the cache as they go): the
        calibrated costs interpolated in the cache positions attended (attention's share of a
        round grows with them). Read-only (kept for the next segment that attends as far)."""
        return self._costs_at(mode, bucket, self._reach(furthest))

    def _reach(self, furthest: int) -> tuple[int, ...]:
        """The cache positions a segment's rounds attend over, halfway through it, at each k of
        self.ks when its furthest row starts at `furthest`."""
        rounds = self.config.segment_rounds
        return tuple(self._attended(furthest + rounds * (k + 1) // 2) for k in self.ks)

    def _costs_at(self, mode: str, bucket: int, reach: tuple[int, ...]) -> np.ndarray:
        """round_costs for rounds that attend over `reach` positions at each k."""
        key = (mode, bucket, reach)
        costs = self._cost_memo.get(key)
        if costs is None:
            table = self.costs[mode][bucket]  # [positions, len(ks)]
            if len(self.cost_reach) == 1 or self.cost_reach[-1] == self.cost_reach[0]:
                costs = table[0].copy()
            else:
                share = (np.array(reach) - self.cost_reach[0]) / (self.cost_reach[-1] - self.cost_reach[0])
                costs = table[0] + np.clip(share, 0.0, 1.0) * (table[-1] - table[0])
            costs.flags.writeable = False
            self._cost_memo[key] = costs
        return costs

    def _compile_ahead(self):
        """The segment programs (the largest) compiled side by side in threads (XLA compiles
        outside the GIL), where JAX's persistent cache will hand them to their first calls; without
        the cache each compiles at its first call, one after another."""
        import jax

        if not jax.config.jax_compilation_cache_dir:
            return
        jobs = [(mode == "greedy", bucket) for mode in self.modes() for bucket in self.buckets]

        def compile_one(job):
            with self.model.mesh_context():
                self._device.compile_segment(greedy=job[0], bucket=job[1])

        with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
            list(pool.map(compile_one, jobs))

    # ----- requests -----

    def check(self, request: Request) -> Request:
        """Refuses a request the engine cannot serve, naming the field; -> the request."""
        if not isinstance(request, Request):
            raise InputError(f"request: expected a jaxmtp.engine.Request, found {type(request).__name__}")
        vocab = self.model.config.vocab_size
        prompt = request.prompt
        if not len(prompt):
            raise InputError("prompt: empty; a request needs at least one prompt token")
        if checks.host_token_ids("prompt", list(prompt), vocab).ndim != 1:
            raise InputError("prompt: expected a sequence of token ids, found a nested sequence")
        max_tokens = checks.whole("max_tokens", request.max_tokens, minimum=1)
        if len(prompt) + max_tokens > self.max_len:
            raise InputError(f"max_tokens: the prompt's {len(prompt)} tokens plus max_tokens = {max_tokens} exceed "
                             f"this server's context of {self.max_len} tokens")
        checks.real("temperature", request.temperature, minimum=0)
        checks.real("top_p", request.top_p, minimum=0, maximum=1, above_minimum=True)
        checks.whole("top_k", request.top_k, minimum=0)
        if request.seed is not None:
            checks.whole("seed", request.seed)
        if request.temperature > 0 and not self.config.sampling:
            raise InputError("temperature: this engine decodes greedily only (started without sampling); use 0")
        if request.stop and self.tokenizer is None:
            raise InputError("stop: stop strings need the model's tokenizer, which this engine was not given")
        checks.stop_strings(request.stop)
        self._stop_table(request)
        return request

    def _stop_table(self, request: Request) -> np.ndarray:
        """The request's stop table [N, L]: its EOS ids (unless ignore_eos) and stop_token_ids."""
        c = self.config
        sequences = checks.stop_sequences(list(map(list, request.stop_token_ids)), self.model.config.vocab_size)
        if not request.ignore_eos:
            sequences = tuple((i,) for i in self.eos_token_ids) + sequences
        if len(sequences) > c.stop_sequences:
            raise InputError(f"stop_token_ids: {len(sequences)} stop sequences (EOS ids included) exceed the "
                             f"{c.stop_sequences} this engine takes")
        if any(len(s) > c.stop_length for s in sequences):
            raise InputError(f"stop_token_ids: a sequence longer than the {c.stop_length} tokens this engine takes")
        table = np.full((c.stop_sequences, c.stop_length), NEVER, np.int32)
        for row, s in zip(table, sequences):
            row[:] = ANY
            row[c.stop_length - len(s):] = s
        return table

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Handle:
        """Queues a request (checked first); its events go to on_event, called on the engine's thread."""
        self.check(request)
        with self._lock:
            if not self._admitting:
                why = f"it failed ({self.failed})" if self.failed else "not started, or shutting down"
                raise NotAdmitting(f"the engine is not taking requests: {why}")
            if len(self._inbox) + len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self._inbox) + len(self._waiting)} requests are waiting, the most this engine "
                                "queues", retry_after=1.0)
            handle = Handle(request, on_event, next(self._ids))
            self._inbox.append(handle)
            self._lock.notify_all()
        return handle

    def stored_blocks(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's leading chunks the prefix store holds now, of those a prefill
        could reuse (0 without a store); changes nothing, callable from any thread."""
        if self._prefix is None:
            return 0
        return self._prefix.held(prompt, self._reusable_blocks(prompt))

    def _reusable_blocks(self, prompt: Sequence[int]) -> int:
        """The prompt's leading chunks a prefill may take from the store: those before its last
        _prefill_tail positions, which it prefills itself."""
        return max(0, (len(prompt) - self._prefill_tail) // self.config.prefill_chunk)

    def generate(self, prompts, *, timeout: float | None = None, **fields) -> list[list[int]]:
        """Submits each prompt (token ids) as a Request with these fields and waits for all ->
        each prompt's new tokens. A request that ends in an error raises it."""
        done = threading.Semaphore(0)
        results = [[] for _ in prompts]
        errors = []

        def listener(i):
            def on_event(event: Event):
                results[i].extend(event.tokens)
                if event.finish_reason is not None:
                    if event.error:
                        errors.append(f"prompt {i}: {event.error}")
                    done.release()
            return on_event

        for i, p in enumerate(prompts):
            self.submit(Request(prompt=tuple(int(t) for t in p), **fields), listener(i))
        for _ in prompts:
            if not done.acquire(timeout=timeout):
                raise TimeoutError("generate: requests still running after the timeout")
        if errors:
            raise InputError("; ".join(errors))
        return results

    def force_k(self, k: int | None):
        """Every segment at this k (one of self.ks: any k up to the largest with auto, else the fixed
        k) instead of the chooser's, or None to choose again: for measuring fixed k on the same
        compiled programs."""
        if k is not None:
            checks.whole("k", k, minimum=0, maximum=self.k_max)
            if k not in self.ks:
                raise InputError(f"force_k: this engine runs k = {self.k_max} only (speculative_k='auto' runs "
                                 f"every k up to its largest)")
        self._forced = k

    def stop_admitting(self):
        with self._lock:
            self._admitting = False

    @property
    def idle(self) -> bool:
        with self._lock:
            return not (self._inbox or self._waiting or self._staged or self._prefilled or any(self._running))

    def shutdown(self, timeout: float = 30.0):
        """Stops admitting, lets what runs finish for up to `timeout` seconds, cancels the rest and
        stops the engine's thread."""
        self.stop_admitting()
        deadline = time.monotonic() + timeout
        while not self.idle and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.01)
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    def snapshot(self) -> dict:
        """Counts for metrics: queue, slots, token and draft totals, rounds by k, segments by batch bucket,
        finished by reason."""
        with self._lock:  # each request moves between these states under the lock: counted once
            waiting = len(self._inbox) + len(self._waiting)
            prefilling = int(self._staged is not None and self._staged.handle.id >= 0) + len(self._prefilled)
            running = sum(r is not None for r in self._running) + prefilling
            finished = dict(self.finished)
        return {"waiting": waiting, "running": running, "prefilling": prefilling,
                "slots": self.slots, "max_queue": self.config.max_queue, **self.counters,
                "rounds_by_k": dict(self.rounds_by_k), "segments_by_bucket": dict(self.segments_by_bucket),
                "current_k": self._segment_k,
                "requests_finished": finished}

    # ----- the engine's thread -----

    def _run(self):
        with self.model.mesh_context():
            while True:
                with self._lock:
                    while not self._stop and not (self._inbox or self._waiting or self._staged or self._prefilled
                                                  or any(self._running)):
                        if not self._lock.wait(IDLE_SECONDS):
                            self._device.noop()  # the other processes wait in a collective
                    stopping = self._stop
                    if not stopping:
                        self._waiting.extend(self._inbox)
                        self._inbox.clear()
                if stopping:
                    self._stop_prefiller()
                    self._device.stop()
                    break
                try:
                    self._step()
                except Exception as error:  # a bug: end every request with it rather than hang them
                    with self._lock:
                        self._admitting = False  # later submits are refused, not left waiting
                    self._stop_prefiller()
                    self.failed = f"{type(error).__name__}: {error}"
                    self._fail_all(self.failed)
                    raise
            self._fail_all(None)

    def _step(self):
        """One pass: cancellations, then prefill chunks of waiting requests for at most
        prefill_share of the last segment's time per request waiting (at least one chunk; each
        chunk timed as it runs, since a chunk late in a long prompt attends over more positions),
        then a decode segment. One prompt arriving costs the running requests about prefill_share
        of their pace; a queue gets prefill time in proportion, so that it does not wait on
        segments that keep few rows busy."""
        self._drop_cancelled()
        if self.concurrent:
            self._step_beside()
            return
        spent = 0.0
        while True:
            if self._staged is None:
                self._admit()
            if self._staged is None:
                break
            with self._lock:
                waiting = 1 + len(self._waiting) + len(self._inbox)
            if spent and any(self._running) and spent >= self.config.prefill_share * waiting * self._segment_seconds:
                break
            began = time.perf_counter()
            self._stage_step()
            self._device.ready()
            self._chunk_seconds = time.perf_counter() - began
            spent += self._chunk_seconds
            self._busy["prefill"] += self._chunk_seconds
        if any(self._running):
            began = time.perf_counter()
            self._decode()
            self._segment_seconds = (time.perf_counter() - began) / self._last_rounds * self.config.segment_rounds

    def _emit(self, handle: Handle, event: Event):
        try:
            handle.on_event(event)
        except Exception as error:  # a listener's failure ends its own request only
            print(f"jaxmtp engine: request {handle.id}'s listener failed ({type(error).__name__}: {error}); "
                  "cancelling it", file=sys.stderr)
            handle.cancel()

    def _finish(self, handle: Handle, reason: str, prompt_tokens: int, completion: int, cached: int = 0,
                error: str | None = None, *, slot: int | None = None, counted: bool = False):
        """Counts the request as finished (unless the caller has, with the state it left) and frees
        its slot in the same step under the lock, so that a snapshot never sees it in neither
        state; then sends its last event (outside the lock: listeners run their own code)."""
        with self._lock:
            if slot is not None:
                self._running[slot] = None
                self._lock.notify_all()  # the prefill thread may stage a request for it
            if not counted:
                self.finished[reason] += 1
        self._emit(handle, Event(finish_reason=reason, error=error, prompt_tokens=prompt_tokens,
                                 completion_tokens=completion, cached_tokens=cached))

    def _fail_all(self, error: str | None):
        """Ends every request: with an error (a failure), or as cancelled (shutdown)."""
        reason = "error" if error else "cancelled"
        with self._lock:
            waiting = [*self._waiting, *self._inbox]
            self._inbox.clear()
            self._waiting = collections.deque()
            if self._staged is not None:
                waiting.append(self._staged.handle)
                self._staged = None
            waiting.extend(staged.handle for staged in self._prefilled)
            self._prefilled.clear()
            self.finished[reason] += len(waiting)
        for handle in waiting:
            self._finish(handle, reason, len(handle.request.prompt), 0, error=error, counted=True)
        for slot, running in enumerate(self._running):
            if running is not None:
                self._finish(running.handle, reason, running.prompt_len, running.delivered, running.cached, error,
                             slot=slot)

    def _drop_cancelled(self):
        with self._lock:
            cancelled = [h for h in self._waiting if h.cancelled]
            self._waiting = collections.deque(h for h in self._waiting if not h.cancelled)
            if self._staged is not None and self._staged.handle.cancelled and not self.concurrent:
                cancelled.append(self._staged.handle)
                self._staged = None
            self.finished["cancelled"] += len(cancelled)
        for handle in cancelled:
            self._finish(handle, "cancelled", len(handle.request.prompt), 0, counted=True)
        for slot, running in enumerate(self._running):
            if running is not None and running.handle.cancelled:
                self._release(slot, "cancelled")

    def _release(self, slot: int, reason: str):
        running = self._running[slot]
        self._finish(running.handle, reason, running.prompt_len, running.delivered, running.cached, slot=slot)

    def _admit(self):
        with self._lock:
            if not self._waiting:
                return
            free = self._free_slots()
            if not free:
                return
            handle = self._waiting.popleft()
            self._staged = _Staged(handle, free[0], 0, len(handle.request.prompt) - 1, 0)  # no longer waiting
        self._begin(self._staged)

    def _free_slots(self) -> list[int]:
        """Slots neither running nor held by a request being prefilled or waiting for its slot."""
        held = {staged.slot for staged in self._prefilled} | ({self._staged.slot} if self._staged else set())
        return [s for s, r in enumerate(self._running) if r is None and s not in held]

    def _begin(self, staged: _Staged):
        """Puts a request into the staging state, with its prefix's chunks copied from the store."""
        request, chunk = staged.handle.request, self.config.prefill_chunk
        prompt = np.asarray(request.prompt, np.int32)
        seq = np.zeros((self.static.cache_len + self.k_max + 1,), np.int32)
        seq[:len(prompt)] = prompt
        seed = request.seed if request.seed is not None else int(self._seeds.integers(2**31))
        greedy = request.temperature == 0
        vocab = self.model.config.vocab_size
        self._device.begin(seq, stops=self._stop_table(request), length=len(prompt), limit=request.max_tokens,
                           temperature=request.temperature if not greedy else 1.0,
                           top_k=request.top_k if 0 < request.top_k < vocab else vocab, top_p=request.top_p,
                           greedy=greedy, seed=seed)
        if self._prefix is not None and staged.handle.id >= 0:
            entries = self._prefix.match(request.prompt, self._reusable_blocks(request.prompt))
            if entries:
                ids = np.zeros((self._device.blocks,), np.int32)
                ids[:len(entries)] = entries
                self._device.load(ids, len(entries))
                staged.start = staged.cached = len(entries) * chunk
        self._staged = staged

    def _prefill_overhead(self) -> float:
        """What speculating adds to each second of decoding in prefill: prompts are prefilled with
        the MTP pass while k > 0 (see _drafting), which takes draft_share of a chunk, and the engine
        has recently spent this many seconds prefilling per second decoding. Where prompts are
        long against the tokens generated, speculation must gain that much in its rounds to pay."""
        return self.draft_share * self._busy["prefill"] / max(self._busy["decode"], 1e-9)

    def _prefill_bound(self) -> bool:
        """Whether, with prefill beside the segments, requests wait for the prefill thread while a
        slot is free for them: the prefill then bounds the throughput, so that speculation's gain in
        the segments buys nothing while its MTP pass in every prefill chunk costs, and auto decodes
        plainly (benchmarks/serving.py at concurrency 16)."""
        if not self.concurrent or not (self._waiting or self._inbox):  # (read without the lock: a request
            return False  # that arrives as this reads is seen at the next segment)
        with self._lock:
            return bool(self._waiting or self._inbox) and bool(self._free_slots())

    def _explore(self, rates: Sequence[float]) -> int | None:
        """After _explore_after rounds at k = 0 in a row, the k > 0 of the highest predicted rate
        (rates [k_max + 1]), for one segment, or None: rounds at k = 0 measure no acceptance, and
        one segment now and then lets auto see that the text has changed and drafting pays. The
        pooled counts used to decay back to the fixed prior instead, which is above the demo's
        acceptance, so that auto went back to drafting every few hundred plain rounds, for whole
        requests, where plain decoding was faster (benchmarks/serving.py at concurrency 1). Each
        exploring segment doubles the wait for the next, up to EXPLORE_ROUNDS_MOST, until auto
        chooses a k > 0 of itself (_choose_k), so that where plain decoding stays faster, exploring
        (a refill and a segment at k > 0) takes a small, shrinking share of auto's rounds
        (benchmarks/engine_ab.py at concurrency 1 counts them, and auto's throughput beside plain's)."""
        drafting = rates[1:]
        if self._plain_rounds < self._explore_after or not max(drafting) > 0:
            return None
        self._plain_rounds = 0
        self._explore_after = min(2 * self._explore_after, EXPLORE_ROUNDS_MOST)
        return 1 + max(range(len(drafting)), key=drafting.__getitem__)

    def _drafting(self) -> bool:
        """Whether prefill chunks run the MTP pass now: not while auto decodes plainly (k = 0), where
        it would add to every chunk for drafts that no round reads. A prompt prefilled without it
        drafts from a refill (its last AUTO_SEGMENT positions) once speculation resumes; for its
        earlier positions the MTP layer's cache holds what the slot's last request left, which can
        lower its acceptance, never change its output."""
        if not self.k_max:
            return False
        if self._forced is not None:
            return self._forced > 0
        return not self.auto or self._chooser.k != 0

    def _stage_step(self):
        """One prefill chunk of the staged request; after its last, the request takes its slot."""
        if self._prefill_chunk(self._staged):
            self._take_slot(self._staged)

    def _prefill_chunk(self, staged: _Staged) -> bool:
        """The staged request's next chunk (the smallest of chunk_sizes that holds what is left,
        else a whole chunk). -> whether it was the prompt's last."""
        size = self._chunk_plan(staged)[0]
        staged.drafted = self._drafting()
        self._device.chunk(staged.start, size, draft=staged.drafted)
        staged.start += size
        if self._v4:  # V4's chunks are stored as they are prefilled (engine.v4: their rings)
            self._store_chunk(staged, (staged.start - size) // self.config.prefill_chunk, size)
        return staged.start > staged.last

    def _chunk_plan(self, staged: _Staged) -> list[int]:
        """The sizes of the staged request's chunks still to run: whole chunks, then the smallest of
        chunk_sizes that holds the rest."""
        left, chunk = staged.last - staged.start + 1, self.config.prefill_chunk
        whole = max(left - 1, 0) // chunk
        return [chunk] * whole + [next(size for size in self.chunk_sizes if size >= left - whole * chunk)]

    def _take_slot(self, staged: _Staged):
        """The prefilled request into its slot, its first token delivered, its prefix stored."""
        token, logprob, done = self._device.insert(staged.slot, staging=staged.buffer)
        self._stale[staged.slot] = not staged.drafted  # the last chunk drafted the first draft, or not
        if staged.handle.id < 0:  # calibration's request
            self._staged = None
            return
        if not self.concurrent:  # (the prefill thread stores its prefix before handing it over)
            self._store_prefix(staged)
        request = staged.handle.request
        self.counters["prompt_tokens_total"] += len(request.prompt)
        self.counters["cached_prompt_tokens_total"] += staged.cached
        receiver = streaming.Receiver(1, self.tokenizer, request.stop) if request.stop else None
        running = _Running(staged.handle, len(request.prompt), request.temperature == 0,
                           accepted_at=np.zeros(self.k_max, np.int64), receiver=receiver, cached=staged.cached)
        with self._lock:  # from prefilling to decoding in one step, for snapshot
            if self._staged is staged:
                self._staged = None
            if staged in self._prefilled:
                self._prefilled.remove(staged)
            self._running[staged.slot] = running
        self._chooser.reset(staged.slot)
        self._deliver(staged.slot, [token], [logprob], done)

    # ----- concurrent_prefill -----

    def _step_beside(self):
        """One pass with prefill on its own thread: the requests it has prefilled take their slots
        (or end, cancelled), then a decode segment runs beside its chunks; with nothing to decode,
        the pass waits for the prefill."""
        if self._prefill_error is not None:
            raise RuntimeError(f"prefill failed: {self._prefill_error}") from self._prefill_error
        with self._lock:
            ready = list(self._prefilled)
        for staged in ready:
            self._busy["prefill"] += staged.seconds
            if staged.handle.cancelled:
                with self._lock:
                    self._prefilled.remove(staged)
                    self.finished["cancelled"] += 1
                self._finish(staged.handle, "cancelled", len(staged.handle.request.prompt), 0, counted=True)
            else:
                self._take_slot(staged)  # out of _prefilled as it takes its slot
            with self._lock:  # its staging state is the prefill thread's again
                self._device.take_back(staged.buffer)
                self._lock.notify_all()
        if any(self._running):
            self._decode()
            return
        with self._lock:
            if not self._prefilled and not self._stop:
                self._lock.wait(IDLE_SECONDS)

    def _prefill_loop(self):
        """The prefill thread: admits a waiting request into a free slot and a free staging state,
        prefills it chunk by chunk (stopping early where it is cancelled), stores its prefix, and
        hands it over to the engine's thread to take its slot; then the next, while the engine's
        thread inserts the last (two staging states). The prefix store is this thread's."""
        while True:
            with self._lock:
                while not self._stop and not (self._device.staging is not None and (self._waiting or self._inbox)
                                              and self._free_slots()):
                    self._lock.wait()
                if self._stop:
                    return
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                self._admit()  # (nothing where the engine's thread has just dropped the waiting, cancelled)
                staged = self._staged
                if staged is None:
                    continue
                last = False
                while not staged.handle.cancelled and not last:
                    began = time.perf_counter()
                    plan = self._chunk_plan(staged)
                    staged.due = began + sum(self._chunk_times.get(size, self.chunk_seconds) for size in plan)
                    last = self._prefill_chunk(staged)
                    self._device.ready(decode=False)
                    seconds = time.perf_counter() - began
                    self._chunk_times[plan[0]] = seconds
                    staged.seconds += seconds
                if last:
                    self._store_prefix(staged)
            except Exception as error:  # the engine's thread raises it (_step_beside)
                self._prefill_error = error
                staged = self._staged  # (_admit sets it before _begin, the first that can fail)
            with self._lock:
                staged.buffer = self._device.hand_over()
                staged.prefilled = True
                self._staged = None
                self._prefilled.append(staged)
                self._lock.notify_all()
            if self._prefill_error is not None:
                return

    def _stop_prefiller(self):
        if self._prefiller is not None:
            with self._lock:
                self._stop = True
                self._lock.notify_all()
            self._prefiller.join()

    def _store_chunk(self, staged: _Staged, chunk: int, size: int):
        """A V4 prompt's chunk `chunk`, just prefilled, into the prefix store where it is a whole
        chunk of the prompt and not stored yet."""
        request = staged.handle.request
        if self._prefix is None or staged.handle.id < 0 or size != self.config.prefill_chunk:
            return
        if chunk >= len(request.prompt) // size:
            return
        entry = self._prefix.place_one(request.prompt, chunk)
        if entry is not None:
            self._store_blocks([chunk], [entry])

    def _store_prefix(self, staged: _Staged):
        if self._prefix is None or self._v4:  # V4 stored its chunks as it prefilled them
            return
        request, chunk = staged.handle.request, self.config.prefill_chunk
        blocks = (len(request.prompt) - 1) // chunk  # whole chunks followed by a prompt token
        chunks, entries = self._prefix.place(request.prompt, blocks)
        if chunks:
            self._store_blocks(chunks, entries)

    def _store_blocks(self, chunks: list[int], entries: list[int]):
        """Copies the staged chunks into store entries; the index arrays have one length (the
        cache's chunks), padded with an entry past the store's end, which the copy skips."""
        blocks = np.zeros((self._device.blocks,), np.int32)
        slots = np.full((self._device.blocks,), self.config.prefix_blocks, np.int32)
        blocks[:len(chunks)], slots[:len(entries)] = chunks, entries
        self._device.store(blocks, slots)

    def _deliver(self, slot: int, tokens: list[int], logprobs: list[float], done: bool):
        """New tokens of a slot's request to its listener; a finished request frees its slot."""
        running = self._running[slot]
        request = running.handle.request
        if running.receiver is not None and tokens:
            kept = running.receiver.receive(np.asarray([running.receiver.tokens[0] + tokens]), np.zeros(1, np.int64),
                                            np.asarray([len(running.receiver.tokens[0]) + len(tokens)]))[0]
            if running.receiver.stopped[0]:
                tokens, logprobs, done = kept, logprobs[:len(kept)], True
        running.delivered += len(tokens)
        self.counters["generation_tokens_total"] += len(tokens)
        if tokens:
            self._emit(running.handle, Event(tokens=tuple(tokens), logprobs=tuple(logprobs) if request.logprobs else None,
                                             prompt_tokens=running.prompt_len, completion_tokens=running.delivered,
                                             cached_tokens=running.cached))
        if done:
            reason = "length" if running.delivered >= request.max_tokens else "stop"
            self._release(slot, reason)

    def _decode(self):
        """One segment on the live slots' bucket, at the chosen k; its tokens delivered."""
        held = np.array([r is not None for r in self._running])
        live = np.flatnonzero(held).tolist()
        mode = "greedy" if all(self._running[s].greedy for s in live) else "mixed"
        if not self.config.sampling:
            mode = "greedy"
        furthest = max(self._running[s].prompt_len + self._running[s].delivered for s in live)
        reach = self._reach(furthest)
        bucket = self._bucket(mode, len(live), reach)
        if self._forced is not None:
            k = self._forced
        elif self.auto:
            k = self._choose_k(live, self._costs_at(mode, bucket, reach))
        else:
            k = self.k_max
        # Free slots keep the flag their last request left, which the program ignores: refill only
        # the live rows.
        refill = self._stale & held & (k > 0)
        with self._lock:
            early = bool(self._waiting or self._inbox) and len(live) == self.slots
        rounds = self._segment_rounds()
        self._last_rounds = rounds
        self._device.ready(staging=not self.concurrent)  # the segment's time alone, not that of copies still
        # running before it (the staging state is the prefill thread's)
        began = time.perf_counter()
        report = self._device.segment(greedy=mode == "greedy", bucket=bucket, k=k, rounds=rounds, refill=refill,
                                      early=early, halt=~held)
        seconds = time.perf_counter() - began
        self._busy = {name: BUSY_DECAY * spent for name, spent in self._busy.items()}
        self._busy["decode"] += seconds
        self._segment_k = k
        self._stale[live] = k == 0  # rounds at k = 0 leave the MTP state behind; at k > 0 it is current
        self.counters["segments_total"] += 1
        self.segments_by_bucket[bucket] += 1
        ran = max(self._account(slot, k, report) for slot in live)
        self.rounds_by_k[k] += ran
        if self.auto:
            self._plain_rounds = self._plain_rounds + ran if k == 0 else 0

    def _choose_k(self, live: list[int], costs: np.ndarray) -> int:
        """Auto's k for a segment of the `live` rows whose calibrated seconds per round at each k
        are `costs` [k_max + 1]: the chooser's, from the rows' expected tokens per second.

        The costs are calibration's, not rescaled by what serving segments measure: the relative
        cost of the k is what decides, and calibration measures every k on the same rows back to
        back (on one engine, within 4% of what serving's segments measured at buckets 1 and 2),
        while serving segments measure each k at other times, under other contention. Learned per
        k, one k's few unlucky segments made it look a third dearer or cheaper than another, by
        run, and auto drafted where plain decoding was faster (benchmarks/serving.py at
        concurrency 4 on two replicas)."""
        if self._prefill_bound():
            scale = math.inf
        else:
            # Drafting also costs what calibration's rounds do not show (the MTP pass in the
            # prefill chunks, refills), and the chooser's acceptance runs a few percent above what
            # the rows then accept: at two rows on one engine, calibration and acceptance rated
            # k = 1 2% above plain rounds where its segments delivered 5% fewer tokens per second.
            scale = (1 + self._prefill_overhead()) * (1 + self.config.draft_margin)
        # (Python floats: the chooser's few numbers cost less so than as numpy arrays, between
        # segments of a few milliseconds at one row)
        tokens, seconds = self._chooser.expected(live), costs.tolist()
        rates = [tokens[0] / seconds[0]] + [t / (s * scale) for t, s in zip(tokens[1:], seconds[1:])]
        explore = self._explore(rates)
        if explore is not None:
            return explore
        k = self._chooser.choose(rates)
        if k:
            self._explore_after = EXPLORE_ROUNDS
        return k

    def _segment_rounds(self) -> int:
        """Rounds for the next segment: segment_rounds, except while a prompt is prefilled. Between
        segments its chunks take at most prefill_share of a segment, the segment made longer where
        a chunk takes more. Beside them (concurrent_prefill) the segment ends about when its last
        chunk does, so that the request takes its slot without waiting out a whole segment and the
        prefill thread goes on to the next."""
        rounds, staged = self.config.segment_rounds, self._staged
        per_round = self._segment_seconds / rounds
        if staged is None or staged.prefilled:
            return rounds
        if not self.concurrent:
            share = self.config.prefill_share * per_round
            return int(np.clip(np.ceil(self._chunk_seconds / share), rounds, self.max_rounds))
        return int(np.clip(np.ceil((staged.due - time.perf_counter()) / per_round), 1, rounds))

    def _bucket(self, mode: str, live: int, reach: tuple[int, ...]) -> int:
        """The bucket a segment of `live` rows runs in: of those that hold them, the one whose
        calibrated round at the engine's lowest k costs least where the rows attend, if by more
        than BUCKET_MARGIN against the smallest, else the smallest. A bucket smaller than every
        slot gathers its rows' caches from their slots and scatters them back
        (programs.take_rows), so that the slots' bucket can cost less than a smaller one where the
        caches attended are short (benchmarks/engine_latency.py's round costs: 16 rows of 16 slots
        below 8 rows at 256 positions attended, above them at 4,224). reach: _reach(the furthest
        position of the live rows)."""
        fits = [b for b in self.buckets if b >= live]
        costs = [self._costs_at(mode, b, reach)[0] for b in fits]
        cheapest = min(range(len(fits)), key=costs.__getitem__)
        return fits[cheapest] if costs[cheapest] < (1 - BUCKET_MARGIN) * costs[0] else fits[0]

    def _account(self, slot: int, k: int, report: programs.Report) -> int:
        """A live slot's part of a segment's report: its acceptance counted, its new tokens
        delivered. -> the rounds it ran."""
        running = self._running[slot]
        if running is None:
            return 0
        rounds = int(report.rounds[slot]) - running.rounds
        accepted_at = report.accepted_at[slot].astype(np.int64)
        gained = accepted_at - running.accepted_at if self.k_max else accepted_at
        running.rounds, running.accepted_at = int(report.rounds[slot]), accepted_at
        if self.auto:
            self._chooser.record(slot, k, rounds, gained)
        self.counters["drafted_total"] += k * rounds
        self.counters["accepted_total"] += int(gained[:k].sum()) if k else 0
        new = int(report.count[slot]) - running.delivered
        tokens = report.recent[slot, self.window - new:].tolist() if new > 0 else []
        logprobs = report.recent_logprobs[slot, self.window - new:].tolist() if new > 0 else []
        self._deliver(slot, tokens, logprobs, bool(report.done[slot]))
        return rounds


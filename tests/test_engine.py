"""The serving engine under load: every greedy request equals its prompt's plain greedy decoding,
whatever arrives beside it and whatever k the segments run; sampled requests in a mixed batch
follow the model's distribution (chi-square against full forward passes); prefix reuse gives the
same tokens; cancellation, stop strings and a full queue behave."""

import contextlib
import itertools
import random
import threading
import time

import jax
import numpy as np
import pytest
import tokenizers

import generation_models as gm
import jaxmtp
from jaxmtp import data, layout
from jaxmtp.engine import Engine, Event, NotAdmitting, QueueFull, Replicas, Request
from jaxmtp.engine.device import Device
from jaxmtp.engine.engine import BUCKET_MARGIN
from jaxmtp.errors import InputError
from jaxmtp.sharding import make_mesh
from test_speculative_sampling import CONFIG, PROMPT, VOCAB, chi_square_p_value, exact_distribution

CHUNK = 32


@pytest.fixture(scope="module")
def demo():
    """The demo model, decoding in the checkpoint layout, its layers scanned (jaxmtp.layout.CHECKPOINT),
    as a real DeepSeek checkpoint does (over MAX_UNROLLED_BYTES); the demo's unrolled layers serve in
    tests/test_serve.py."""
    model = jaxmtp.load(jaxmtp.DEMO_MODEL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout, "MAX_UNROLLED_BYTES", 0)
        assert model.decoding().layout == layout.CHECKPOINT  # chosen once and kept by the model
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.Tokenizer.from_file(f"{jaxmtp.DEMO_MODEL}/tokenizer.json")


@pytest.fixture(scope="module")
def engine(demo, tokenizer):
    engine = Engine(demo, tokenizer=tokenizer, slots=8, buckets=(2, 8), max_len=256, prefill_chunk=CHUNK,
                    segment_rounds=4, prefix_blocks=16, max_queue=64, sampling=False).start()
    yield engine
    engine.shutdown(timeout=5)


@pytest.fixture(scope="module")
def mixed(demo, tokenizer):
    """32 held-out prompts of mixed lengths, their max_tokens, and their plain greedy tokens (rows
    are independent: one generate call for all)."""
    prompts = corpus_prompts(tokenizer, 32)
    limits = [8 + (7 * i) % 33 for i in range(32)]
    return prompts, limits, jaxmtp.generate(demo, prompts, max_new_tokens=max(limits)).tokens


def corpus_prompts(tokenizer, count, seed=0):
    """Held-out text prompts of mixed lengths (5..150 tokens)."""
    rng = random.Random(seed)
    texts = data.held_out_prompts(tokenizer, count, 160)
    return [p[:rng.randint(5, 150)] for p in texts]


class Collector:
    """Gathers one request's events; `done` is set by its last."""

    def __init__(self):
        self.tokens, self.events, self.done = [], [], threading.Event()

    def __call__(self, event: Event):
        self.events.append(event)
        self.tokens.extend(event.tokens)
        if event.finish_reason is not None:
            self.done.set()

    @property
    def finish(self):
        return self.events[-1]


def staggered(engine, prompts, limits, **fields):
    """Submits the requests from another thread a few milliseconds apart (they arrive while the
    earlier ones decode) -> their collectors, once all have finished."""
    collectors = [Collector() for _ in prompts]

    def send():
        for p, m, c in zip(prompts, limits, collectors):
            engine.submit(Request(prompt=tuple(p), max_tokens=m, **fields), c)
            time.sleep(random.Random(len(p)).uniform(0, 0.01))

    sender = threading.Thread(target=send)
    sender.start()
    sender.join()
    for c in collectors:
        assert c.done.wait(120), "a request never finished"
    return collectors


@contextlib.contextmanager
def nothing_compiled():
    """Fails the block if any program is traced and lowered while it runs (an eager operation on a
    new shape, a jitted program not compiled at start): a started engine compiles nothing more."""
    lowered = []

    def listener(event, seconds, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not lowered, f"{len(lowered)} programs compiled after the engine started"


@contextlib.contextmanager
def k_switching(engine, every: float = 0.003):
    """While the block runs, the engine's k flips between 0 and 2 every `every` seconds; then auto."""
    finished = threading.Event()

    def switch():
        for i in itertools.count():
            if finished.wait(every):
                return
            engine.force_k(2 * (i % 2))

    switcher = threading.Thread(target=switch)
    switcher.start()
    try:
        yield
    finally:
        finished.set()
        switcher.join()
        engine.force_k(None)


@contextlib.contextmanager
def segments_run(engine):
    """While the block runs, each segment's (bucket, live slots) is appended to the list it yields."""
    device, ran = engine._device, []
    segment = device.segment

    def recorded(**fields):
        ran.append((fields["bucket"], set(np.flatnonzero(~fields["halt"]).tolist())))
        return segment(**fields)

    device.segment = recorded
    try:
        yield ran
    finally:
        del device.segment


def gathered(ran, bucket: int) -> bool:
    """Whether a segment ran in `bucket` with its live rows in slots past the bucket's first rows."""
    return any(b == bucket and live and max(live) >= bucket for b, live in ran)


@pytest.mark.parametrize("k", ["auto", "switching"])
def test_greedy_requests_under_load_equal_plain_greedy_alone(engine, mixed, k):
    """"switching": k flips between 0 and 2 every few milliseconds, so that prompts are prefilled
    with and without the MTP pass, segments at k = 2 refill the rows that plain ones left behind,
    and segments at a fixed k run too."""
    assert engine.concurrent  # on a CPU in one process, prompts are prefilled on a thread beside the segments
    prompts, limits, reference = mixed
    before = dict(engine.snapshot()["rounds_by_k"])
    engine.force_k(None)
    with nothing_compiled(), k_switching(engine) if k == "switching" else contextlib.nullcontext():
        collectors = staggered(engine, prompts, limits)
    for i, (c, want, m) in enumerate(zip(collectors, reference, limits)):
        assert c.finish.finish_reason == "length", (i, c.finish)
        assert c.tokens == want[:m], f"request {i} (prompt of {len(prompts[i])} tokens) differs from plain greedy"
        assert c.finish.completion_tokens == m and c.finish.prompt_tokens == len(prompts[i])
    snapshot = engine.snapshot()
    assert snapshot["running"] == 0 and snapshot["waiting"] == 0
    if k == "switching":
        ran = {j: n - before.get(j, 0) for j, n in snapshot["rounds_by_k"].items()}
        assert ran.get(0, 0) > 0 and ran.get(2, 0) > 0


def test_calibration_rows_carry_tokens_of_their_own(engine):
    """Calibration times rounds on rows that each read their own seeded random ids
    (programs.occupy), so that a round of several rows, or a verify pass of several positions, routes
    to as many experts as text does instead of sending every row to the same ones; the rows outside
    the bucket are left done, where they were. Through the device side as calibration calls it (a
    host mask of the rows), on a device side of the engine's settings apart from its running one."""
    static, vocab, slots = engine.static, engine.model.config.vocab_size, engine.slots

    def occupied(rows):
        side = Device(engine._device.s)
        side.fresh()
        side.occupy(rows, 40)
        return side.state

    rows = np.arange(slots) < 3
    state = occupied(rows)
    seq, n = np.asarray(state.tokens.seq), np.asarray(state.tokens.n)
    assert n.tolist() == [40] * 3 + [0] * (slots - 3) and np.asarray(state.tokens.done).tolist() == (~rows).tolist()
    assert ((seq >= 0) & (seq < vocab)).all() and not seq[3:].any()
    window = seq[:3, 40:40 + 3 * static.k + 3]  # the tokens the rows' first rounds read
    assert len({tuple(row) for row in window}) == 3 and len(np.unique(window)) >= window.size // 2
    np.testing.assert_array_equal(np.asarray(occupied(rows).tokens.seq), seq)  # seeded: every calibration alike


def test_drafting_resumes_exactly_beside_slots_that_plain_rounds_left(engine, mixed):
    """Plain rounds leave their slots' MTP state behind, and a segment at k > 0 refills its stale
    rows first: requests decoded at k = 0, then one at k = 2 beside the slots they left, each equal
    their plain greedy decoding alone."""
    prompts, _, reference = mixed
    try:
        engine.force_k(0)
        assert engine.generate(prompts[:3], max_tokens=8) == [want[:8] for want in reference[:3]]
        engine.force_k(2)
        assert engine.generate(prompts[3:4], max_tokens=40) == [reference[3][:40]]
    finally:
        engine.force_k(None)


# Two slots, prefilled between segments, greedy only, plain: the two tests below share these programs.
BETWEEN = dict(buckets=(2,), max_len=256, prefill_chunk=CHUNK, segment_rounds=4, sampling=False, speculative_k=0,
               concurrent_prefill=False)


def test_prefill_between_segments_under_load_equals_plain_greedy(demo, mixed):
    """concurrent_prefill=False (as with several processes): prompts prefilled a chunk at a time
    between the segments of two slots, while later requests wait for a slot."""
    prompts, limits, reference = (part[:12] for part in mixed)
    engine = Engine(demo, slots=2, **BETWEEN).start()
    try:
        assert not engine.concurrent and engine._prefiller is None
        with nothing_compiled():  # plain decoding's prefill chunks (no MTP pass) among them
            collectors = staggered(engine, prompts, limits)
        for i, (c, want, m) in enumerate(zip(collectors, reference, limits)):
            assert c.tokens == want[:m], f"request {i} differs from plain greedy"
        assert engine.idle
    finally:
        engine.shutdown(timeout=5)


def test_replicas_share_requests_and_send_a_prefix_to_the_replica_that_holds_it(demo, tokenizer, mixed):
    """Two replicas of two slots: greedy requests under load equal plain greedy and both replicas
    decode some; the snapshot sums the replicas'; prompts that share a stored prefix go to the
    replica that stored it and reuse it."""
    with pytest.raises(InputError, match="4 slots do not divide into 3 replicas"):
        Replicas(demo, replicas=3, slots=4, **BETWEEN)
    prompts, limits, reference = (part[:12] for part in mixed)
    pool = Replicas(demo, replicas=2, slots=4, tokenizer=tokenizer, **BETWEEN).start()
    try:
        with nothing_compiled():  # the second replica runs the first's programs, and takes its costs
            collectors = staggered(pool, prompts, limits)
        for i, (c, want, m) in enumerate(zip(collectors, reference, limits)):
            assert c.tokens == want[:m], f"request {i} differs from plain greedy"
        each = [engine.snapshot()["generation_tokens_total"] for engine in pool.engines]
        assert min(each) > 0 and pool.snapshot()["generation_tokens_total"] == sum(each) == sum(limits)
        assert pool.snapshot()["slots"] == 4
        shared = data.held_out_prompts(tokenizer, 1, 4 * CHUNK)[0][:3 * CHUNK + 1]
        tails = [p[:20] for p in data.held_out_prompts(tokenizer, 4, 40)]
        alike = [shared + t for t in tails]  # test_prefix_reuse_gives_the_same_tokens's prompts
        want = jaxmtp.generate(demo, alike, max_new_tokens=12).tokens
        assert pool.generate(alike[:1], max_tokens=12, timeout=60) == want[:1]
        holds = [engine.stored_blocks(alike[1]) for engine in pool.engines]
        assert sorted(holds) == [0, 3], holds
        rest = [Collector() for _ in alike[1:]]
        for p, c in zip(alike[1:], rest):
            pool.submit(Request(prompt=tuple(p), max_tokens=12), c)
        for c, w in zip(rest, want[1:]):
            assert c.done.wait(60)
            assert c.tokens == w and c.finish.cached_tokens == 3 * CHUNK
    finally:
        pool.shutdown(timeout=5)
    assert pool.idle


def test_concurrent_prefill_needs_one_device(demo):
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, mesh=make_mesh(data=8))
    with pytest.raises(InputError, match="concurrent_prefill: needs one process on one device.*8 device"):
        Engine(model, slots=8, max_len=256, concurrent_prefill=True)
    assert not Engine(model, slots=8, max_len=256, speculative_k=0).concurrent  # the default, on a mesh


def test_an_engine_of_fixed_k_runs_that_k_alone(demo):
    """A fixed k's programs hold the rounds of that k only: forcing another is refused by name."""
    engine = Engine(demo, slots=2, max_len=64, prefill_chunk=16, speculative_k=1)
    assert engine.ks == (1,)
    engine.force_k(1)
    with pytest.raises(InputError, match="force_k: this engine runs k = 1 only"):
        engine.force_k(0)
    assert Engine(demo, slots=2, max_len=64, prefill_chunk=16).ks == (0, 1, 2)  # auto on a CPU: every k to 2


def test_the_last_rows_run_in_a_small_bucket_from_their_slots(engine, demo, tokenizer):
    """Eight requests take slots 0..7; the two that run longest (the last two) then decode in the
    bucket of 2, gathered from their slots, and still equal plain greedy. The bucket of 2 is made
    the cheaper one here, as calibration measures it on a quiet machine: the choice of bucket is
    timing's, this test is the gathered bucket's tokens."""
    prompts = [p[:12] for p in corpus_prompts(tokenizer, 8, seed=3)]
    limits = [24] * 6 + [64, 64]
    reference = jaxmtp.generate(demo, prompts, max_new_tokens=64).tokens
    calibrated = engine.costs
    engine.costs = {mode: {**costs, 2: costs[8] / 2} for mode, costs in calibrated.items()}
    engine._cost_memo.clear()  # (the costs interpolated so far, from the calibrated table)
    try:
        with segments_run(engine) as ran:
            collectors = [Collector() for _ in prompts]
            for p, m, c in zip(prompts, limits, collectors):
                engine.submit(Request(prompt=tuple(p), max_tokens=m), c)
            for c in collectors:
                assert c.done.wait(120)
    finally:
        engine.costs = calibrated
        engine._cost_memo.clear()
    for i, (c, want, m) in enumerate(zip(collectors, reference, limits)):
        assert c.tokens == want[:m], f"request {i} differs from plain greedy"
    assert gathered(ran, 2), ran


def test_a_larger_bucket_takes_the_rows_only_where_calibrated_cheaper_by_the_margin(engine):
    """Two live rows fit the buckets of 2 and 8: the bucket of 8 runs them only where its
    calibrated round costs more than BUCKET_MARGIN less than the bucket of 2's; three rows fit
    the bucket of 8 alone."""
    calibrated, reach = engine.costs, engine._reach(40)
    try:
        for ratio, want in ((1 + BUCKET_MARGIN, 2), (1 - BUCKET_MARGIN / 2, 2), (1 - 2 * BUCKET_MARGIN, 8)):
            engine.costs = {mode: {2: np.ones_like(c[2]), 8: ratio * np.ones_like(c[8])}
                            for mode, c in calibrated.items()}
            engine._cost_memo.clear()
            assert engine._bucket("greedy", 2, reach) == want, ratio
            assert engine._bucket("greedy", 3, reach) == 8
    finally:
        engine.costs = calibrated
        engine._cost_memo.clear()


def test_prefix_reuse_gives_the_same_tokens(engine, demo, tokenizer):
    # Three whole chunks and the token after them (the MTP entry at a chunk's last position reads it).
    shared = data.held_out_prompts(tokenizer, 1, 4 * CHUNK)[0][:3 * CHUNK + 1]
    tails = [p[:20] for p in data.held_out_prompts(tokenizer, 4, 40)]
    prompts = [shared + t for t in tails]
    reference = jaxmtp.generate(demo, prompts, max_new_tokens=12).tokens
    before = engine.snapshot()["cached_prompt_tokens_total"]
    first = Collector()
    engine.submit(Request(prompt=tuple(prompts[0]), max_tokens=12), first)
    assert first.done.wait(60)
    rest = [Collector() for _ in prompts[1:3]]
    for p, c in zip(prompts[1:3], rest):
        engine.submit(Request(prompt=tuple(p), max_tokens=12), c)
    for c in rest:
        assert c.done.wait(60)
    assert first.tokens == reference[0]
    for c, want in zip(rest, reference[1:3]):
        assert c.tokens == want
        assert c.finish.cached_tokens == 3 * CHUNK  # the shared chunks came from the store
    assert engine.generate([prompts[3]], max_tokens=12, timeout=60) == reference[3:]  # the blocking form
    assert engine.snapshot()["cached_prompt_tokens_total"] - before >= 3 * 3 * CHUNK


def test_stops_cancellation_and_refusals(engine, demo, tokenizer):
    prompt = corpus_prompts(tokenizer, 1, seed=3)[0]
    plain = jaxmtp.generate(demo, [prompt], max_new_tokens=30).tokens[0]
    # A stop sequence of two generated tokens ends the request right after them.
    c = Collector()
    engine.submit(Request(prompt=tuple(prompt), max_tokens=30, stop_token_ids=(tuple(plain[5:7]),)), c)
    assert c.done.wait(60)
    assert c.tokens == plain[:7] and c.finish.finish_reason == "stop"
    # A stop string: the tokens up to the one that completes it.
    text = tokenizer.decode(plain[:12])
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    c = Collector()
    engine.submit(Request(prompt=tuple(prompt), max_tokens=30, stop=(stop,)), c)
    assert c.done.wait(60)
    assert stop in tokenizer.decode(c.tokens) and stop not in tokenizer.decode(c.tokens[:-1])
    assert c.finish.finish_reason == "stop" and c.tokens == plain[:len(c.tokens)]
    # A cancelled request ends as cancelled and frees its slot.
    c = Collector()
    handle = engine.submit(Request(prompt=tuple(prompt), max_tokens=150), c)
    handle.cancel()
    assert c.done.wait(60)
    assert c.finish.finish_reason == "cancelled"
    deadline = time.time() + 10
    while not engine.idle and time.time() < deadline:
        time.sleep(0.01)
    assert engine.idle
    # Bad requests name their field.
    for request, field in [(Request(prompt=(), max_tokens=1), "prompt"), (Request(prompt=(1,), max_tokens=0), "max_tokens"),
                           (Request(prompt=(1,) * 250, max_tokens=10), "max_tokens"),
                           (Request(prompt=(1, 99999), max_tokens=1), "prompt"),
                           (Request(prompt=(1,), max_tokens=1, temperature=0.5), "temperature"),
                           (Request(prompt=(1,), max_tokens=1, top_p=0), "top_p"),
                           (Request(prompt=(1,), max_tokens=1, stop_token_ids=((1,),) * 9), "stop_token_ids")]:
        with pytest.raises(InputError, match=field):
            engine.submit(request, Collector())


def test_a_full_queue_refuses_and_shutdown_ends_everything(demo):
    engine = Engine(demo, slots=2, buckets=(2,), max_len=256, prefill_chunk=CHUNK, segment_rounds=4, max_queue=2,
                    sampling=False, speculative_k=0).start()
    collectors = [Collector() for _ in range(4)]
    submitted = []
    with pytest.raises(QueueFull) as full:
        for c in collectors * 4:
            submitted.append(engine.submit(Request(prompt=(1, 2, 3), max_tokens=200), c))
    assert full.value.retry_after > 0
    engine.shutdown(timeout=0)
    with pytest.raises(NotAdmitting):
        engine.submit(Request(prompt=(1,), max_tokens=1), Collector())
    for c in {id(c): c for c in collectors}.values():
        if c.events:
            assert c.done.is_set() and c.finish.finish_reason in ("cancelled", "length")


def test_sampled_requests_in_a_mixed_batch_follow_the_model():
    """Sampled rows beside greedy rows, every segment at k = 2: the first two tokens of 1,024
    sampled requests (the prefill's, and the first verify round's: an accepted draft or a draw from
    the residual) against the exact distribution from full forward passes; the greedy rows equal
    plain greedy. Every other prompt is prefilled without the MTP pass (as while auto decodes
    plainly), so that its first draft comes from the segment's refill of its row alone (an auto
    engine's programs: those of a fixed k never refill)."""
    model = gm.model("partial", CONFIG, head_scale=0.25)
    samples, temperature, top_k, top_p, new = 1024, 1.0, 0, 0.9, 2
    engine = Engine(model, slots=32, buckets=(32,), max_len=32, prefill_chunk=16, segment_rounds=4,
                    prefix_blocks=0, max_queue=8192, speculative_k="auto")
    engine.start()
    drafting = itertools.cycle([True, False])  # one chunk per prompt here
    engine._drafting = lambda: next(drafting)
    try:
        engine.force_k(2)
        greedy = jaxmtp.generate(model, [PROMPT], max_new_tokens=new).tokens[0]
        collectors = []
        for i in range(samples + samples // 8):
            c = Collector()
            c.greedy = i % 9 == 8
            if c.greedy:
                engine.submit(Request(prompt=tuple(PROMPT), max_tokens=new), c)
            else:
                engine.submit(Request(prompt=tuple(PROMPT), max_tokens=new, temperature=temperature, top_k=top_k,
                                      top_p=top_p, seed=i), c)
            collectors.append(c)
        for c in collectors:
            assert c.done.wait(300)
        drafted, accepted = engine.snapshot()["drafted_total"], engine.snapshot()["accepted_total"]
    finally:
        engine.shutdown(timeout=5)
    assert all(c.tokens == greedy for c in collectors if c.greedy)
    sampled = np.array([c.tokens for c in collectors if not c.greedy])
    assert sampled.shape == (samples, new)
    counts = np.zeros((VOCAB,) * new)
    np.add.at(counts, tuple(sampled.T), 1)
    expected = exact_distribution(model, temperature, top_k, top_p).sum(axis=2) * samples  # the first two tokens
    assert chi_square_p_value(counts.ravel(), expected.ravel()) > 1e-3
    assert 0.05 < accepted / drafted < 0.95  # both the accept and the reject paths ran


def test_chooser_expectation_follows_every_count_that_changes():
    """Chooser.expected against the formulas written out: a row's conditional acceptance at draft
    position i is (its hits + the pooled estimate x SLOT_PRIOR_ROUNDS) / (its tries +
    SLOT_PRIOR_ROUNDS), the pooled estimate (pooled hits + the fixed prior) / (pooled tries +
    PRIOR_ROUNDS), counts decayed per round; expected tokens per round at k are 1 + the sum over
    i < k of the product of the first i + 1 conditionals, summed over the rows. Asked again after
    rounds at k = 0 (which change no count), after drafting rounds and after a slot is reset."""
    from jaxmtp import adaptive
    from jaxmtp.engine.engine import POOLED_DECAY, SLOT_PRIOR_ROUNDS, Chooser

    k_max, slots = 3, 4
    tried = [[0.0] * k_max for _ in range(slots)]
    hits = [[0.0] * k_max for _ in range(slots)]
    pooled_tried, pooled_hits = [0.0] * k_max, [0.0] * k_max

    def count(slot, k, rounds, accepted_at):  # the counts as Chooser.record documents them
        nonlocal pooled_tried, pooled_hits
        if not k or not rounds:
            return
        new_tried = [rounds] + [accepted_at[i - 1] if i < k else 0 for i in range(1, k_max)]
        new_hits = [accepted_at[i] if i < k else 0 for i in range(k_max)]
        d, p = adaptive.DECAY ** rounds, POOLED_DECAY ** rounds
        tried[slot] = [d * a + b for a, b in zip(tried[slot], new_tried)]
        hits[slot] = [d * a + b for a, b in zip(hits[slot], new_hits)]
        pooled_tried = [p * a + b for a, b in zip(pooled_tried, new_tried)]
        pooled_hits = [p * a + b for a, b in zip(pooled_hits, new_hits)]

    def want(rows):
        prior = [(h + adaptive.PRIOR_ACCEPTANCE * adaptive.PRIOR_ROUNDS) / (t + adaptive.PRIOR_ROUNDS)
                 for h, t in zip(pooled_hits, pooled_tried)]
        total = [0.0] * (k_max + 1)
        for r in rows:
            reach, tokens = 1.0, [1.0]
            for i in range(k_max):
                reach *= (hits[r][i] + prior[i] * SLOT_PRIOR_ROUNDS) / (tried[r][i] + SLOT_PRIOR_ROUNDS)
                tokens.append(tokens[-1] + reach)
            total = [a + b for a, b in zip(total, tokens)]
        return total

    chooser = Chooser(k_max, slots, hysteresis=0.05)
    steps = [(1, 2, 10, [6, 3, 0]), (1, 0, 8, [0, 0, 0]), (2, 3, 5, [4, 2, 1]), (0, 1, 7, [2, 0, 0]),
             ("reset", 1), (3, 3, 9, [9, 8, 7])]
    for step in steps:
        if step[0] == "reset":
            chooser.reset(step[1])
            tried[step[1]], hits[step[1]] = [0.0] * k_max, [0.0] * k_max
        else:
            slot, k, rounds, accepted_at = step
            chooser.record(slot, k, rounds, np.array(accepted_at))
            count(slot, k, rounds, accepted_at)
        for rows in ([1], [1, 2], [0, 1, 2, 3]):
            np.testing.assert_allclose(chooser.expected(rows), want(rows), rtol=1e-12, err_msg=f"after {step}")

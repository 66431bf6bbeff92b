"""The serving engine on a DeepSeek-V4 model (jaxmtp.engine.v4): greedy requests arriving while
others decode, with k switching between 0 and 2 every few milliseconds, each equal to its prompt's
plain greedy decoding alone; sampled requests beside greedy ones at k = 2 follow the model's
distribution (chi-square against whole forward passes); the refusals V4 adds."""

import os

import jax
import numpy as np
import pytest

from jaxmtp.engine import Engine, Request
from jaxmtp.errors import InputError
from jaxmtp.models.deepseek_v4 import init_v4
from test_deepseek_v4 import SAMPLING, SAMPLING_PROMPT, first_tokens_distribution
from test_engine import Collector, gathered, k_switching, segments_run, staggered
from test_speculative_sampling import chi_square_p_value


@pytest.fixture(scope="module")
def model():
    return init_v4(SAMPLING, seed=4)


# The engine's settings; the server of the serve test takes the same, so that one of them compiles
# the programs and the other loads them from the test run's compile cache (tests/conftest.py).
SETTINGS = dict(slots=16, max_len=64, prefill_chunk=16, prefix_blocks=8, speculative_k="auto")


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, buckets=(16,), max_queue=8192, **SETTINGS)
    engine.start()
    yield engine
    engine.shutdown(timeout=5)


def test_v4_greedy_requests_under_load_equal_plain_greedy_alone(engine, model):
    """Prompts of 1..30 tokens, past the sliding window of 4 and several compression blocks of 2 and
    8, arriving while others decode; k flips between 0 and 2 every 3 ms. Each token's
    log-probability is the model's log-softmax at its position from one whole forward pass, which
    any state left by an earlier request in the staging caches or the slot would change."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, SAMPLING.vocab_size, n).tolist() for n in rng.integers(1, 31, 24)]
    limits = [int(m) for m in rng.integers(1, 17, 24)]
    reference = model.greedy(prompts, max(limits))
    before = dict(engine.snapshot()["rounds_by_k"])
    with k_switching(engine):
        collectors = staggered(engine, prompts, limits, ignore_eos=True, logprobs=True)
    for i, (c, want, m) in enumerate(zip(collectors, reference, limits)):
        assert c.finish.finish_reason == "length", (i, c.finish)
        assert c.tokens == want[:m], f"request {i} (prompt of {len(prompts[i])} tokens) differs from plain greedy"
    rows = [p + c.tokens for p, c in zip(prompts, collectors)]
    padded = np.array([row + [0] * (max(map(len, rows)) - len(row)) for row in rows])
    logits, _ = model.forward(padded, lengths=[len(row) for row in rows])
    logp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))
    for i, (p, c) in enumerate(zip(prompts, collectors)):
        got = [x for event in c.events for x in (event.logprobs or ())]
        want = logp[i, len(p) - 1 + np.arange(len(c.tokens)), c.tokens]
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"request {i}")
    snapshot = engine.snapshot()
    assert snapshot["running"] == 0 and snapshot["waiting"] == 0
    by_k = {j: n - before.get(j, 0) for j, n in snapshot["rounds_by_k"].items()}
    assert by_k.get(0, 0) > 0 and by_k.get(2, 0) > 0


@pytest.mark.skipif(not os.environ.get("JAXMTP_LONG_TESTS"), reason="compiles an engine of two buckets, about 20 "
                    "CPU-seconds (the V3 engine's test runs gathered buckets); set JAXMTP_LONG_TESTS=1 to run it")
def test_v4_last_rows_run_in_a_small_bucket_from_their_slots(model):
    """Sixteen requests take the sixteen slots; the two that run longest (the last two) then decode
    in the bucket of 4, gathered from their slots, and still equal plain greedy."""
    engine = Engine(model, buckets=(4, 16), sampling=False, **SETTINGS).start()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, SAMPLING.vocab_size, 8).tolist() for _ in range(16)]
    limits = [16] * 14 + [48, 48]
    reference = model.greedy(prompts, max(limits))
    try:
        with segments_run(engine) as ran:
            collectors = [Collector() for _ in prompts]
            for p, m, c in zip(prompts, limits, collectors):
                engine.submit(Request(prompt=tuple(p), max_tokens=m, ignore_eos=True), c)
            for c in collectors:
                assert c.done.wait(120)
    finally:
        engine.shutdown(timeout=5)
    for i, (c, want, m) in enumerate(zip(collectors, reference, limits)):
        assert c.tokens == want[:m], f"request {i} differs from plain greedy"
    assert gathered(ran, 4), ran


def test_v4_sampled_requests_in_a_mixed_batch_follow_the_model(engine, model):
    """The first two tokens of 1,024 sampled requests (the prefill's, and the first verify round's:
    an accepted draft or a draw from the residual) at k = 2, beside greedy requests (every ninth),
    against the model's distribution; the greedy ones equal plain greedy."""
    samples, new = 1024, 2
    greedy = model.greedy([SAMPLING_PROMPT], new)[0]
    engine.force_k(2)
    before = engine.snapshot()
    try:
        collectors = []
        for i in range(samples + samples // 8):
            c = Collector()
            c.greedy = i % 9 == 8
            engine.submit(Request(prompt=tuple(SAMPLING_PROMPT), max_tokens=new, ignore_eos=True,
                                  temperature=0.0 if c.greedy else 1.0, seed=i), c)
            collectors.append(c)
        for c in collectors:
            assert c.done.wait(300)
    finally:
        engine.force_k(None)
    after = engine.snapshot()
    assert all(c.tokens == greedy for c in collectors if c.greedy)
    sampled = np.array([c.tokens for c in collectors if not c.greedy])
    assert sampled.shape == (samples, new)
    counts = np.zeros((SAMPLING.vocab_size,) * new)
    np.add.at(counts, tuple(sampled.T), 1)
    expected = first_tokens_distribution(model, SAMPLING_PROMPT, new) * samples
    assert chi_square_p_value(counts.ravel(), expected.ravel()) > 1e-3
    drafted = after["drafted_total"] - before["drafted_total"]
    accepted = after["accepted_total"] - before["accepted_total"]
    assert 0.05 < accepted / drafted < 0.95  # both the accept and the reject paths ran


def test_v4_prefix_reuse_gives_the_same_tokens(engine, model):
    """Prompts that share their first 32 tokens (two chunks, past the window and several compressed
    entries of each rate): after the first, each copies the two chunks' entries and rings from the
    store instead of prefilling them, and decodes plain greedy's tokens."""
    rng = np.random.default_rng(2)
    shared = rng.integers(0, SAMPLING.vocab_size, 32).tolist()
    prompts = [shared + rng.integers(0, SAMPLING.vocab_size, n).tolist() for n in (9, 12, 20, 15)]
    want = model.greedy(prompts, 12)
    cached = []
    for prompt, tokens in zip(prompts, want):  # one at a time: each finds what the ones before stored
        c = Collector()
        engine.submit(Request(prompt=tuple(prompt), max_tokens=12, ignore_eos=True), c)
        assert c.done.wait(120)
        assert c.tokens == tokens
        cached.append(c.finish.cached_tokens)
    assert cached == [0, 32, 32, 32]


def test_v4_engine_refuses_a_chunk_that_splits_compressed_entries():
    model = init_v4(SAMPLING.replace(compress_rates=(32, 8), max_position_embeddings=128))  # one CSA layer: rate 32
    with pytest.raises(InputError, match=r"prefill_chunk: .* multiple of its compression rates \[32\], found 16"):
        Engine(model, slots=2, max_len=64, prefill_chunk=16)
    Engine(model, slots=2, max_len=64, prefill_chunk=16, prefix_blocks=0)  # without reuse it may


def test_jaxmtp_serve_answers_an_openai_client_on_a_v4_checkpoint(tmp_path, model):
    """`jaxmtp serve` of a V4 checkpoint (k chosen by auto, as in the engine tests; greedy programs
    only, as its requests are): a completion and a streamed one of token-id prompts equal plain
    greedy decoding alone."""
    from jaxmtp.models.deepseek_v4.checkpoint import save_v4
    from test_serve import Server

    save_v4(model, tmp_path / "v4")
    prompts = [[3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 2, 1], [7, 7]]
    want = model.greedy(prompts, 10)
    s = SETTINGS
    server = Server(tmp_path / "server.log", "--max-batch", str(s["slots"]), "--buckets", str(s["slots"]),
                    "--max-len", str(s["max_len"]), "--prefill-chunk", str(s["prefill_chunk"]), "--prefix-blocks",
                    str(s["prefix_blocks"]), "--speculative-k", str(s["speculative_k"]), "--greedy-only",
                    model=str(tmp_path / "v4"))
    try:
        client = server.ready().client()
        done = client.completions.create(model="v4", prompt=prompts[0], max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].token_ids == want[0] and done.choices[0].finish_reason == "length"
        chunks = client.completions.create(model="v4", prompt=prompts[1], max_tokens=10, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert [t for chunk in chunks for choice in chunk.choices for t in choice.token_ids] == want[1]
    finally:
        server.stop()
    assert server.process.returncode == 0 and "Traceback" not in server.log.read_text(), server.tail()

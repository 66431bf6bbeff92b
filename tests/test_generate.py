"""jaxmtp.generate: speculative greedy == plain greedy, acceptance statistics, one compile per bucket."""

import collections
import contextlib
import math
import os
import re

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import generation_models as gm
import jaxmtp
from jaxmtp.decoding import AUTO_SEGMENT, advance, refill_drafts, start
from jaxmtp.generation import AUTO_MAX_K_CPU, prepare, unpack
from jaxmtp.layout import prefix_lengths

AUTO_MAX_K = AUTO_MAX_K_CPU  # the most drafts auto chooses from where the tests run, a CPU
MAX_NEW = 12


@contextlib.contextmanager
def compiles():
    """A Counter of the XLA compilations that run inside the block, by jitted function name
    ("start"), from jax.monitoring's backend-compile event (one per program built)."""
    counts = collections.Counter()

    def listen(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            counts[re.sub(r"^jit[(_]|\)$", "", fun_name)] += 1  # "jit(start)", or "jit_start"

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _cut_at_stops(rows, sequences):
    """Each row up to and including its first token that completes one of the token sequences
    within the row (the reference for stopping; an EOS id is a sequence of one)."""
    def end(row):
        return next((i + 1 for i in range(len(row))
                     if any(tuple(row[max(0, i + 1 - len(s)):i + 1]) == s for s in sequences)), len(row))
    return [row[:end(row)] for row in rows]


@settings(max_examples=8, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["partial", "always", "never", "random"]), k=st.integers(1, 4),
       prompts=st.lists(st.lists(st.integers(0, gm.TINY.vocab_size - 1), min_size=1, max_size=12),
                        min_size=3, max_size=4),
       eos_at=st.lists(st.tuples(st.integers(0, 7), st.integers(0, MAX_NEW - 1)), max_size=2),
       stops_at=st.lists(st.tuples(st.integers(0, 7), st.integers(0, MAX_NEW - 1), st.integers(1, 4)), max_size=2))
def test_speculative_greedy_is_plain_greedy(kind, k, prompts, eos_at, stops_at):
    """Speculative greedy == plain greedy, and both stop rows exactly where the first EOS id or stop
    sequence completes (both drawn from what the rows really generate: none to two of each).
    Batches of 3-4 rows share one batch bucket, the other tests' below (so the examples share the
    compiled loops, and a batch may have a padding row); the mesh tests cover 8 rows."""
    model = gm.model(kind)
    plain = jaxmtp.generate(model, prompts, max_new_tokens=MAX_NEW)
    assert all(len(row) == MAX_NEW for row in plain.tokens)
    rows = [plain.tokens[row % len(prompts)] for row, *_ in eos_at + stops_at]
    eos = sorted({row[at] for row, (_, at) in zip(rows, eos_at)}) or None
    stops = sorted({tuple(row[at:at + n]) for row, (_, at, n) in zip(rows[len(eos_at):], stops_at)})
    if eos or stops:
        expected = _cut_at_stops(plain.tokens, [(e,) for e in eos or ()] + stops)
        plain = jaxmtp.generate(model, prompts, max_new_tokens=MAX_NEW, eos_token_id=eos, stop_token_ids=stops)
        assert plain.tokens == expected
    spec = jaxmtp.generate(model, prompts, max_new_tokens=MAX_NEW, speculative_k=k, eos_token_id=eos,
                           stop_token_ids=stops)
    assert spec.tokens == plain.tokens


def test_speculative_greedy_is_plain_greedy_across_cache_prefixes():
    """Rows that run past the first cache prefix that the CPU decode layout attends over (256 of
    512 slots): plain steps and 4-row verify passes cross it at different steps; same tokens."""
    model = gm.model("partial")
    assert model.decoding().layout.prefix_attention and prefix_lengths(512) == (256, 512)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, gm.TINY.vocab_size, n).tolist() for n in (236, 244)]  # 24 new tokens each
    plain = jaxmtp.generate(model, prompts, max_new_tokens=24)
    assert [len(row) for row in plain.tokens] == [24, 24]
    assert jaxmtp.generate(model, prompts, max_new_tokens=24, speculative_k=3).tokens == plain.tokens


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_stats_of_always_and_never_agreeing_mtp(k):
    prompts = [[3, 4, 5], [7], [11, 12, 13, 14, 15, 16]]
    new = 20
    always = jaxmtp.generate(gm.model("always"), prompts, max_new_tokens=new, speculative_k=k).stats
    assert always.acceptance_rate == 1.0
    assert always.mean_accepted_length == k + 1
    assert always.per_position_acceptance == [1.0] * k
    # The prefill makes the first token; each later round commits k + 1.
    assert always.main_forward_passes == 1 + math.ceil((new - 1) / (k + 1))
    assert [row.main_forward_passes for row in always.per_row] == [1 + math.ceil((new - 1) / (k + 1))] * 3
    assert always.accepted_tokens == always.draft_tokens
    never = jaxmtp.generate(gm.model("never"), prompts, max_new_tokens=new, speculative_k=k).stats
    assert never.acceptance_rate == 0.0 and never.accepted_tokens == 0
    assert never.mean_accepted_length == 1.0
    assert never.main_forward_passes == new
    assert never.draft_tokens == 3 * (new - 1) * k


def test_rows_accept_different_counts():
    prompts = [[3, 4, 5], [7], [11, 12, 13, 14, 15, 16], [100, 200]]
    out = jaxmtp.generate(gm.model("partial"), prompts, max_new_tokens=24, speculative_k=3)
    per_row = [row.mean_accepted_length for row in out.stats.per_row]
    assert len(set(per_row)) > 1, per_row
    assert 0.2 < out.stats.acceptance_rate < 0.95


def test_one_compile_per_bucket_and_no_host_callbacks():
    model = gm.model("partial")
    loop = ("start", "advance")
    with compiles() as built:
        first = jaxmtp.generate(model, [list(range(1, 21))], max_new_tokens=64, speculative_k=2)
    assert len(first.tokens[0]) == 64 and [built[name] for name in loop] == [1, 1]  # the prefill and the loop
    # Another prompt length in the same bucket (17..32), other limits, EOS ids and up to 4 stop
    # sequences of up to 4 tokens reuse them, streamed or not.
    with compiles() as built:
        jaxmtp.generate(model, [list(range(5, 35))], max_new_tokens=40, speculative_k=2, eos_token_id=7,
                        stop_token_ids=[[3, 4], [9, 8, 7, 6]])
        list(jaxmtp.generate_stream(model, list(range(5, 35)), max_new_tokens=40, speculative_k=2,
                                    eos_token_id=[7, 8], stop_token_ids=[[5, 6]]))
    assert [built[name] for name in loop] == [0, 0], built
    # Longer ones are another bucket.
    with compiles() as built:
        jaxmtp.generate(model, [list(range(5, 35))], max_new_tokens=40, speculative_k=2, stop_token_ids=[[1] * 5])
    assert [built[name] for name in loop] == [1, 1], built
    prepared = prepare(model, [list(range(1, 21))], max_new_tokens=64, speculative_k=2)
    state = jax.eval_shape(start, prepared.static, prepared.params, prepared.inputs)
    jaxpr = str(jax.make_jaxpr(advance, static_argnums=0)(prepared.static, prepared.params, state, prepared.inputs,
                                                          64, prepared.inputs.real))
    assert "callback" not in jaxpr and "while" in jaxpr


def test_bad_arguments_fail_before_any_work():
    model = gm.model("partial")
    too_long = [[1] * model.config.max_position_embeddings]
    with pytest.raises(ValueError, match=r"prompts\[0\]: 2048 tokens leave no room"):
        jaxmtp.generate(model, too_long)
    with pytest.raises(ValueError, match=r"prompts\[1\]\[0\]: token id 512 outside the vocabulary \[0, 512\)"):
        jaxmtp.generate(model, [[1], [512]])
    with pytest.raises(ValueError, match=r"speculative_k: expected an integer 0..8, found 9"):
        jaxmtp.generate(model, [[1]], speculative_k=9)
    with pytest.raises(ValueError, match="needs an MTP module"):
        jaxmtp.generate(model.without_mtp(), [[1]], speculative_k=1)


@pytest.mark.parametrize("arguments, error, message", [
    (dict(prompts=[[1.5, 2]]), TypeError, r"prompts\[0\]\[0\]: expected an integer, found 1.5"),
    (dict(prompts=[[1, "2"]]), TypeError, r"prompts\[0\]\[1\]: expected an integer, found '2'"),
    (dict(prompts=[[None]]), TypeError, r"prompts\[0\]\[0\]: expected an integer, found None"),
    (dict(prompts=[[True]]), TypeError, r"prompts\[0\]\[0\]: expected an integer, found True"),
    (dict(prompts=[1, 2, 3]), TypeError, "prompts: expected a list of prompts .* found a flat list"),
    (dict(prompts=np.array([1, 2, 3])), TypeError, r"prompts: expected a 2-D array .* shape \(3,\)"),
    (dict(prompts=np.array([[1.0, 2.0]])), TypeError, r"prompts\[0\]: expected a 1-D integer array"),
    (dict(prompts="1 2 3"), TypeError, "prompts: expected a list of token-id lists, found str"),
    (dict(prompts=[]), ValueError, "prompts: expected at least one prompt"),
    (dict(prompts=[[1], []]), ValueError, r"prompts\[1\]: empty"),
    (dict(prompts=[[-1]]), ValueError, r"prompts\[0\]\[0\]: token id -1 outside the vocabulary"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens: expected an integer, found 2.5"),
    (dict(max_new_tokens="4"), TypeError, "max_new_tokens: expected an integer, found '4'"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens: expected an integer >= 1, found 0"),
    (dict(speculative_k=1.5), TypeError, "speculative_k: expected an integer, found 1.5"),
    (dict(speculative_k="2"), ValueError, "speculative_k: expected \"auto\" or an integer 0..8, found '2'"),
    (dict(speculative_k=True), TypeError, "speculative_k: expected an integer, found True"),
    (dict(temperature=float("nan")), ValueError, "temperature: expected a finite number >= 0, found nan"),
    (dict(temperature="0.5"), TypeError, "temperature: expected a number, found '0.5'"),
    (dict(top_p=0.0), ValueError, r"top_p: expected a finite number > 0 and <= 1, found 0.0"),
    (dict(top_k=2.5), TypeError, "top_k: expected an integer, found 2.5"),
    (dict(seed="x"), TypeError, "seed: expected an integer, found 'x'"),
    (dict(eos_token_id="1"), TypeError, "eos_token_id: expected an integer, found '1'"),
    (dict(eos_token_id=[1, 512]), ValueError, r"eos_token_id\[1\]: token id 512 outside the vocabulary"),
])
def test_bad_argument_types_are_named(arguments, error, message):
    arguments = {"prompts": [[1, 2]]} | arguments
    with pytest.raises(error, match=message):
        jaxmtp.generate(gm.model("partial"), arguments.pop("prompts"), **arguments)


def test_array_prompts_and_a_top_k_past_the_vocabulary():
    model = gm.model("partial")
    listed = jaxmtp.generate(model, [[3, 4, 5], [6, 7, 8]], max_new_tokens=6)
    assert jaxmtp.generate(model, np.array([[3, 4, 5], [6, 7, 8]]), max_new_tokens=6).tokens == listed.tokens
    # top-k over the whole vocabulary keeps every token: the same draws as no top-k at all.
    sampled = [jaxmtp.generate(model, [[3, 4, 5]], max_new_tokens=12, temperature=1.0, top_k=top_k, seed=3).tokens
               for top_k in (0, model.config.vocab_size + 100)]
    assert sampled[0] == sampled[1] and len(set(sampled[0][0])) > 1


def test_forward_refuses_ids_outside_the_vocabulary_and_mismatched_mtp_shapes():
    model = gm.model("partial")
    for bad in ([[1, 512]], [[-1, 2]]):
        with pytest.raises(ValueError, match=r"tokens: token id -?\d+ outside the vocabulary \[0, 512\)"):
            model.forward(bad)
    with pytest.raises(TypeError, match="tokens: expected integer token ids, found dtype float64"):
        model.forward([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"tokens: expected shape \[batch, length\], found \(2,\)"):
        model.forward([1, 2])
    _, hidden = model.forward([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"hidden must be \[B, T, hidden_size\] = \[1, 2, 64\] .* found \[1, 3, 64\]"):
        model.mtp_forward(hidden, [[1, 2]])


def test_generation_stops_at_max_position_embeddings():
    model = gm.model("always")
    model = jaxmtp.Model(model.config.replace(max_position_embeddings=40), model.params)
    prompts = [[1] * 30, [2] * 10]
    for k in (0, 2):
        out = jaxmtp.generate(model, prompts, max_new_tokens=50, speculative_k=k)
        assert [len(row) for row in out.tokens] == [10, 30]


def test_generate_cli_prints_the_api_tokens(tmp_path, capsys):
    from jaxmtp.cli import main

    model = gm.model("partial")
    jaxmtp.save(model, tmp_path / "m", format="hf")
    main(["generate", "--model", str(tmp_path / "m"), "--tokens", "1,2,3;9,8", "--k", "2", "--max-new-tokens", "10",
          "--ignore-eos", "--quiet"])
    printed = capsys.readouterr().out
    expected = jaxmtp.generate(model, [[1, 2, 3], [9, 8]], max_new_tokens=10).tokens
    for prompt, tokens in zip([[1, 2, 3], [9, 8]], expected):
        assert f"{prompt} -> " + " ".join(map(str, tokens)) + "\n" in printed
    assert "tokens/s" in printed and "acceptance rate" in printed


def test_generate_cli_with_a_tokenizer(tmp_path, capsys):
    from jaxmtp.cli import main

    model = gm.model("partial")
    jaxmtp.save(model, tmp_path / "m", format="hf")
    tokenizer = gm.byte_tokenizer(tmp_path / "m" / "tokenizer.json")
    main(["generate", "def fib", "--model", str(tmp_path / "m"), "--k", "1", "--max-new-tokens", "6",
          "--ignore-eos", "--quiet"])
    ids = tokenizer.encode("def fib").ids
    expected = tokenizer.decode(ids) + tokenizer.decode(jaxmtp.generate(model, [ids], max_new_tokens=6).tokens[0])
    assert expected in capsys.readouterr().out


@settings(max_examples=3, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["partial", "always", "never"]),
       prompts=st.lists(st.lists(st.integers(0, gm.TINY.vocab_size - 1), min_size=1, max_size=12),
                        min_size=3, max_size=4))
def test_auto_k_greedy_is_plain_greedy(kind, prompts):
    """Auto == plain greedy; batches of 3-4 rows, the bucket of the forced-k tests below (one
    compiled auto loop for both)."""
    model = gm.model(kind)
    plain = jaxmtp.generate(model, prompts, max_new_tokens=MAX_NEW)
    auto = jaxmtp.generate(model, prompts, max_new_tokens=MAX_NEW, speculative_k="auto")
    assert auto.tokens == plain.tokens
    costs = auto.stats.round_costs
    assert len(costs) == AUTO_MAX_K + 1 and all(c > 0 for c in costs) and plain.stats.round_costs is None
    assert list(costs) == sorted(costs)  # a round at k costs at least one at k - 1
    for row in auto.stats.per_row:  # every round of a row is counted at the k it ran
        assert sum(row.rounds_by_k.values()) == row.main_forward_passes - 1


@pytest.mark.parametrize("force", [0, 1, AUTO_MAX_K])
def test_every_forced_k_of_the_auto_loop_is_plain_greedy(force):
    """The auto loop's branches, each taken for a whole run, give plain greedy's tokens."""
    model = gm.model("partial")
    prompts = [[3, 4, 5], [7], [11, 12, 13, 14, 15, 16]]
    plain = jaxmtp.generate(model, prompts, max_new_tokens=20)
    prepared = prepare(model, prompts, max_new_tokens=20, speculative_k="auto")
    out = unpack(prepared, prepared.run(prepared.inputs.replace(force_k=jax.numpy.int32(force))))
    assert out.tokens == plain.tokens
    assert set(out.stats.rounds_by_k) == {force}


def test_auto_loop_updates_its_caches_in_place():
    """The compiled auto loop (the forced-k test's bucket) copies none of its caches: every round
    variant writes the main and MTP caches where they are. Passed through a switch whose branches
    held loops, XLA copied each cache twice per segment, which also held a second copy of them all
    in memory."""
    prepared = prepare(gm.model("partial"), [[3, 4, 5], [7], [11, 12, 13, 14, 15, 16]], max_new_tokens=20,
                       speculative_k="auto")
    static, params, inputs = prepared.static, prepared.params, prepared.inputs
    state = jax.eval_shape(start, static, params, inputs)
    caches = {f"{x.dtype.name[0]}{x.dtype.itemsize * 8}[{','.join(map(str, x.shape))}]"  # e.g. f32[4,64,8]
              for x in jax.tree.leaves((state.caches, state.drafts.cache))}
    program = advance.lower(static, params, state, inputs, jax.numpy.int32(1), jax.numpy.zeros_like(inputs.real))
    text = program.compile().as_text()
    assert all(cache in text for cache in caches)  # written as HLO writes types
    copied = re.findall(r"= (\w+\[[\d,]*\])\S* copy\(", text)  # the copies' types
    assert copied and not caches & set(copied), caches & set(copied)


def test_auto_keeps_the_draft_of_a_speculative_segment():
    """After a segment at k > 0 its last repair has written the MTP slots and drafted d1 as the
    refill would, so the next segment at k > 0 starts without one: the refill over the same state
    writes the same slots and drafts the same d1 (greedy), from the same MTP hidden state."""
    prepared = prepare(gm.model("partial"), [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], max_new_tokens=100,
                       speculative_k="auto")
    static, params, inputs = prepared.static, prepared.params, prepared.inputs
    halt = jax.numpy.zeros_like(inputs.real)
    state = start(static, params, inputs)
    for k in (0, 2, 3):  # a plain segment, the refill before the first speculative one, then none
        state = advance(static, params, state, inputs.replace(force_k=jax.numpy.int32(k)), jax.numpy.int32(1), halt)[0]
    assert int(state.stats.drafted[0]) > 0 and not bool(state.auto.stale) and not bool(state.tokens.done[0])
    refilled = refill_drafts(static, params, state, inputs.sampling, jax.random.key(0))
    n, drafts = int(state.tokens.n[0]), state.drafts
    assert int(refilled.token[0]) == int(drafts.token[0])
    np.testing.assert_allclose(refilled.hidden, drafts.hidden, rtol=1e-5, atol=1e-6)
    for name in ("c_kv", "k_pe"):
        np.testing.assert_allclose(getattr(refilled.cache, name)[:, n - AUTO_SEGMENT:n],
                                   getattr(drafts.cache, name)[:, n - AUTO_SEGMENT:n], rtol=1e-5, atol=1e-6)


def test_auto_follows_acceptance():
    """With costs under which every k pays at the prior's acceptance (the most drafts the most), an MTP that
    is always right is driven up to the most drafts, one more per segment from k = 1, and one that
    is never right is turned off within two segments, the first at k = 1 (the prior's acceptance
    of the drafts after the first, which it never reaches, can make the second k = 2)."""
    prompts = [[3, 4, 5]]
    costs = [1.0, 1.5, 1.8, 2.0][:AUTO_MAX_K + 1]
    runs = {}
    for kind in ("always", "never"):
        prepared = prepare(gm.model(kind), prompts, max_new_tokens=100, speculative_k="auto").with_costs(costs)
        runs[kind] = unpack(prepared, prepared.run()).stats.rounds_by_k
    climb = {k: AUTO_SEGMENT for k in range(1, AUTO_MAX_K)}
    assert {k: n for k, n in runs["always"].items() if k < AUTO_MAX_K} == climb and runs["always"][AUTO_MAX_K] >= 5
    never = runs["never"]
    assert never[1] == AUTO_SEGMENT and sum(n for k, n in never.items() if k) <= 2 * AUTO_SEGMENT and never[0] >= 60


def test_auto_drafts_afresh_after_rounds_at_k0():
    """Rounds at k = 0 draft nothing; the speculative segment after them drafts from the newest
    position, so with an MTP layer that is always right its every draft is accepted, the first
    round's included (the bucket of the test above: one compiled auto loop for both)."""
    prepared = prepare(gm.model("always"), [[3, 4, 5]], max_new_tokens=100, speculative_k="auto")
    static, params, inputs = prepared.static, prepared.params, prepared.inputs
    halt = jax.numpy.zeros_like(inputs.real)
    state = start(static, params, inputs)
    for k in (0, AUTO_MAX_K):  # one segment each
        state = advance(static, params, state, inputs.replace(force_k=jax.numpy.int32(k)), jax.numpy.int32(1), halt)[0]
    assert np.asarray(state.stats.rounds_at)[0].tolist() == [AUTO_SEGMENT] + [0] * (AUTO_MAX_K - 1) + [AUTO_SEGMENT]
    assert int(state.stats.accepted[0]) == int(state.stats.drafted[0]) == AUTO_SEGMENT * AUTO_MAX_K
    plain = jaxmtp.generate(gm.model("always"), [[3, 4, 5]], max_new_tokens=100).tokens[0]
    count = int(state.tokens.count[0])
    assert np.asarray(state.tokens.seq)[0, 3:3 + count].tolist() == plain[:count]


@pytest.mark.parametrize("segments", [(0, AUTO_MAX_K), (AUTO_MAX_K,)])
def test_auto_mtp_cache_is_whole_after_rounds_at_k0(segments):
    """Rounds at k = 0 write no MTP slots; a segment at k > 0 first writes those of the last
    AUTO_SEGMENT positions. After one plain segment (or none: a first segment from prompts shorter
    than AUTO_SEGMENT) the MTP cache then holds, at every position a row has reached, what a
    prefill of the row's tokens up to there writes (its slot p pairs h_p with t_{p+1})."""
    model, prompts = gm.model("partial"), [[3, 4, 5], [7], [11, 12, 13, 14, 15, 16]]
    prepared = prepare(model, prompts, max_new_tokens=20, speculative_k="auto")  # the forced-k test's bucket
    static, params, inputs = prepared.static, prepared.params, prepared.inputs
    halt = jax.numpy.zeros_like(inputs.real)
    state = start(static, params, inputs)
    for k in segments:
        state = advance(static, params, state, inputs.replace(force_k=jax.numpy.int32(k)), jax.numpy.int32(1), halt)[0]
    n, seq = np.asarray(state.tokens.n), np.asarray(state.tokens.seq)
    reached = [seq[row, :n[row]].tolist() for row in range(len(prompts))]
    fresh = prepare(model, reached, max_new_tokens=1, speculative_k=1)
    want = start(fresh.static, fresh.params, fresh.inputs).drafts.cache
    for row, length in enumerate(n):
        for got, ref in ((state.drafts.cache.c_kv, want.c_kv), (state.drafts.cache.k_pe, want.k_pe)):
            np.testing.assert_allclose(np.asarray(got)[row, :length], np.asarray(ref)[row, :length], atol=2e-5)


def test_auto_drafts_only_where_a_round_pays_at_the_prior():
    """Costs are in steps of the plain loop, the auto loop's own round at k = 0 included (it may be
    cheaper than one). From the prior (0.7: 1.7, 2.19, 2.53 tokens per round at k = 1..3), an
    MTP that is always right is never tried where no k > 0 yields more tokens per step than k = 0
    (1 / 0.95 against 1.7 / 1.8, 2.19 / 2.3, ...), and is where k = 1 does (1.7 / 1.6); rounds at
    k = 0 measure nothing, so the first choice holds."""
    prepared = prepare(gm.model("always"), [[3, 4]], max_new_tokens=40, speculative_k="auto")
    for costs, drafts in (([0.95, 1.8, 2.3, 2.7], False), ([1.0, 1.6, 2.3, 2.7], True)):
        run = prepared.with_costs(costs[:AUTO_MAX_K + 1])
        stats = unpack(run, run.run()).stats
        assert (stats.draft_tokens > 0) == drafts and sum(stats.rounds_by_k.values()) > 0


def test_greedy_choice_is_numpys_argmax_with_ties_and_nans():
    from jaxmtp.sampling import greedy

    logits = np.random.default_rng(0).normal(size=(5, 3, 2048)).astype(np.float32)
    logits[1, :, [5, 900]] = 10.0  # tied maxima: the first wins
    logits[2, 0] = -np.inf  # all tied
    logits[3, 1, [1500, 7, 40]] = [np.inf, np.nan, np.nan]  # a NaN counts largest, the first of them
    logits[4] = np.round(logits[4])  # many ties
    np.testing.assert_array_equal(greedy(jax.numpy.asarray(logits)), np.argmax(logits, axis=-1))


def test_expected_tokens_and_best_k_follow_the_formula():
    from jaxmtp.adaptive import (DECAY, IDLE_DECAY, PRIOR_ACCEPTANCE, PRIOR_ROUNDS, AcceptanceCounts, best_k,
                                 expected_tokens)

    c = np.array([0.9, 0.5, 0.8, 0.2], np.float32)
    want = [1.0, 1.9, 1.9 + 0.45, 1.9 + 0.45 + 0.36, 1.9 + 0.45 + 0.36 + 0.072]
    np.testing.assert_allclose(expected_tokens(jax.numpy.asarray(c)), want, rtol=1e-6)
    counts = AcceptanceCounts.zeros(4)
    for _ in range(200):  # draft 1 accepted in every round, draft 2 never
        counts = counts.update(4, jax.numpy.array([1]), jax.numpy.array([True]))
    tried = (1 - DECAY ** 200) / (1 - DECAY)  # decayed count of 200 rounds
    prior = PRIOR_ACCEPTANCE * PRIOR_ROUNDS
    np.testing.assert_allclose(counts.conditional(), [(tried + prior) / (tried + PRIOR_ROUNDS),
                                                      prior / (tried + PRIOR_ROUNDS), PRIOR_ACCEPTANCE,
                                                      PRIOR_ACCEPTANCE], rtol=1e-5)
    costs = jax.numpy.array([1.0, 1.5, 1.8, 2.0, 2.2])
    assert int(best_k(counts, costs)) == 1  # 2 tokens for 1.5 steps beats 1 for 1 and ~2.0 for 1.8
    idle = counts.update(0, jax.numpy.array([0]), jax.numpy.array([True]))  # a round at k = 0 measures nothing
    np.testing.assert_allclose(idle.tried, IDLE_DECAY * np.asarray(counts.tried), rtol=1e-6)
    np.testing.assert_allclose(idle.accepted, IDLE_DECAY * np.asarray(counts.accepted), rtol=1e-6)


def test_round_costs_are_measured_once_and_kept(tmp_path, monkeypatch):
    from jaxmtp import calibration

    monkeypatch.setenv("JAXMTP_CACHE_DIR", str(tmp_path))
    calls = []

    def plain_seconds():  # the unit: a step of the plain loop
        calls.append("plain")
        return 0.001

    def round_seconds(k):  # a round of the auto loop at k costs k + 1.25 plain steps
        calls.append(k)
        return 0.001 * (1.25 + k)

    key = "device|model|shapes"
    first = calibration.round_costs(key, plain_seconds, round_seconds, 2)
    assert first == pytest.approx([1.25, 2.25, 3.25])
    assert calls.count("plain") == calibration.REPEATS * 4 + 1  # beside each k; one warm-up call
    count = len(calls)
    again = calibration.round_costs(key, plain_seconds, round_seconds, 2)
    assert again == first and len(calls) == count  # read from the file
    assert (tmp_path / calibration.FILE).exists()
    (tmp_path / calibration.FILE).write_text("not json")  # a damaged file is measured again
    assert calibration.round_costs(key, plain_seconds, round_seconds, 2) == pytest.approx(first) and len(calls) > count


def test_round_costs_cancel_a_machine_that_slows_steadily(tmp_path, monkeypatch):
    """Each k is timed between two plain runs, so a drift of the machine's speed that is linear
    over those three runs cancels: the costs come out as they are, however fast it drifts."""
    from jaxmtp import calibration

    monkeypatch.setenv("JAXMTP_CACHE_DIR", str(tmp_path))
    clock = iter(range(1000))  # one tick per run; each run is 3% slower than the one before it

    def slowed(seconds):
        return seconds * (1 + 0.03 * next(clock))

    steps = [1.1, 1.6, 2.1, 2.6]  # plain steps per round at k = 0..3
    costs = calibration.round_costs("device|model|shapes", lambda: slowed(0.001), lambda k: slowed(0.001 * steps[k]), 3)
    assert costs == pytest.approx(steps)


def test_round_costs_below_their_bound_are_raised(tmp_path, monkeypatch):
    """A round at k > 0 costs at least one at k - 1 (it does its work and more): medians below that
    bound are noise and are raised to it. The round at k = 0 may cost less than a plain step."""
    from jaxmtp import calibration

    monkeypatch.setenv("JAXMTP_CACHE_DIR", str(tmp_path))
    steps = [0.95, 2.3, 2.1, 4.0]  # plain steps per round at k = 0..3, as a noisy machine might read them
    costs = calibration.round_costs("device|model|shapes", lambda: 0.001, lambda k: 0.001 * steps[k], 3)
    assert costs == pytest.approx([0.95, 2.3, 2.3, 4.0])


def test_round_costs_are_keyed_by_the_code_that_measured_them(tmp_path):
    """An upgrade or an edit of jaxmtp changes the key, so its costs are measured again."""
    from jaxmtp import calibration

    (tmp_path / "engine.py").write_text("STEP = 1\n")
    before = calibration.source_digest(str(tmp_path))
    (tmp_path / "engine.py").write_text("STEP = 2\n")
    assert calibration.source_digest(str(tmp_path)) != before
    assert calibration.engine_digest() == calibration.source_digest(os.path.dirname(jaxmtp.__file__))
    key = calibration.key({"hidden_size": 8}, "float32", "layout", "greedy", 1, 16, 64, 4)
    assert key.endswith(f"jaxmtp {calibration.engine_digest()}")


@pytest.mark.parametrize("costs, plain", [([1.1, 1.85, 2.3], True), ([1.0, 1.2, 1.4], False)])
def test_auto_decodes_plainly_where_no_k_pays_and_says_why(tmp_path, monkeypatch, capsys, costs, plain):
    """Round costs under which no k > 0 pays at the prior's acceptance (k = 1 yields 1.7 tokens for
    1.85 steps): auto runs the plain loop (its own would never draft) and `jaxmtp generate` says so
    and why, instead of an acceptance rate of drafts never made. Where k = 1 pays, it drafts."""
    from jaxmtp import calibration
    from jaxmtp.cli import main

    monkeypatch.setenv("JAXMTP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "measure", lambda *args: costs)
    model = gm.model("always")
    out = jaxmtp.generate(model, [[3, 4, 5]], max_new_tokens=12, speculative_k="auto")
    assert out.tokens == jaxmtp.generate(model, [[3, 4, 5]], max_new_tokens=12).tokens
    assert out.stats.chose_plain == plain and (out.stats.draft_tokens == 0) == plain
    assert out.stats.round_costs == pytest.approx(costs)
    jaxmtp.save(model, tmp_path / "m", format="hf")
    main(["generate", "--model", str(tmp_path / "m"), "--tokens", "3,4,5", "--max-new-tokens", "12", "--ignore-eos",
          "--quiet"])
    printed = capsys.readouterr().out
    assert ("decoded plainly: a round drafting k = 1, 2 costs 1.85, 2.30 plain steps" in printed) == plain
    assert ("acceptance rate" in printed) == (not plain)

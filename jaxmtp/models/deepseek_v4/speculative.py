"""Speculative decoding on DeepSeek-V4 with its MTP block, one jitted round at a time.

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
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import checks
from jaxmtp.adaptive import AcceptanceCounts, best_k
from jaxmtp.decoding import AUTO_SEGMENT
from jaxmtp.errors import InputError
from jaxmtp.models.deepseek_v4.model import V4Model
from jaxmtp.models.deepseek_v4.transformer import DeepseekV4
from jaxmtp.sampling import SamplingMode, SamplingParams, choose, split
from jaxmtp.speculative import verify_greedy, verify_sampled


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


@partial(jax.jit, static_argnums=(0, 1, 2))
def prefill(config, dtype, mode: SamplingMode, params, sampling, key, prompt, lengths, caches, mtp_cache):
    """prompt [B, P] right-padded to lengths [B] -> RoundState with t_n at position lengths. The MTP
    block, which attends to the sliding window only, runs on the prompt's last sliding_window
    positions."""
    apply = _module(config, dtype, params)
    b, width = prompt.shape
    first_key, draft_key, key = split(key, 3)
    logits, _, streams, caches = apply(prompt, jnp.zeros(b, jnp.int32), lengths, caches)
    token, _ = choose(first_key, _at(logits, lengths - 1), mode, sampling)
    seq = jnp.concatenate([prompt, jnp.zeros((b, 1), jnp.int32)], axis=1).at[jnp.arange(b), lengths].set(token)
    span = min(config.sliding_window, width)
    start = jnp.maximum(lengths - span, 0)
    at = jnp.clip(start[:, None] + jnp.arange(span)[None], 0, width - 1)
    window = jnp.take_along_axis(streams, at[:, :, None, None], axis=1)
    nexts = jnp.take_along_axis(seq, at + 1, axis=1)
    mtp_logits, mtp_streams, mtp_cache = apply(window, nexts, start, lengths - start, mtp_cache,
                                               method=DeepseekV4.mtp_step)
    last = lengths - start - 1
    draft, probs = choose(draft_key, _at(mtp_logits, last), mode, sampling)
    return RoundState(caches=caches, mtp_cache=mtp_cache, n=lengths, token=token, draft=draft, draft_probs=probs,
                      recycled=_at(mtp_streams, last)[:, None], key=key)


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def run_round(config, dtype, k: int, mode: SamplingMode, repair: bool, params, sampling, state: RoundState):
    """One round of k drafts (0: plain decoding) for every row. `repair` (implied at k > 0) runs the
    MTP block over the committed positions, so that a later round can draft; auto's rounds at k = 0
    do, plain decoding's do not.
    -> (state, committed [B, k + 1]: the first a + 1 of each row are its new tokens, accepted a [B])."""
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
    drafts = jnp.stack(drafts[:k], axis=1).reshape(b, k)
    logits, _, main_streams, caches = apply(jnp.concatenate([state.token[:, None], drafts], axis=1), n,
                                            one * (k + 1), state.caches)
    if mode.greedy:
        accepted, after = verify_greedy(drafts, logits)
    elif k:
        accepted, after = verify_sampled(keys[k], drafts, jnp.stack(probs[:k], axis=1), logits, mode, sampling)
    else:
        accepted, after = jnp.zeros(b, jnp.int32), choose(keys[0], logits[:, 0], mode, sampling)[0]
    committed = jnp.concatenate([drafts, after[:, None]], axis=1).at[jnp.arange(b), accepted].set(after)
    draft, draft_probs, recycled = state.draft, state.draft_probs, state.recycled
    if k or repair:
        mtp_logits, mtp_streams, mtp_cache = apply(main_streams, committed, n, accepted + 1, mtp_cache,
                                                   method=DeepseekV4.mtp_step)
        draft, draft_probs = choose(keys[k + 1], _at(mtp_logits, accepted), mode, sampling)
        recycled = _at(mtp_streams, accepted)[:, None]
    state = RoundState(caches=caches, mtp_cache=mtp_cache, n=n + accepted + 1, token=after, draft=draft,
                       draft_probs=draft_probs, recycled=recycled, key=keys[k + 2])
    return state, committed, accepted


def generate(model: V4Model, prompts, max_new_tokens: int, k: int | str = 0, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, k_max: int = 3, costs=None,
             cache_len: int | None = None, headroom: int | None = None):
    """Decodes each prompt (no stop tokens) with k drafts per round (0: plain; "auto": chosen every
    AUTO_SEGMENT rounds in 0..k_max from `costs` [k_max + 1], a round's cost in plain rounds, and the
    acceptance so far, as jaxmtp.adaptive does), greedily at temperature 0, else sampling from the
    temperature / top-k / top-p distribution. cache_len (positions) and headroom (at least the most
    drafts + 1) size the caches; by default as this call needs, and calls with equal sizes share
    their compiled programs.
    -> (the new tokens of each prompt, (k, accepted a [B]) of every round)."""
    prompts = checks.prompts(prompts, model.config.vocab_size)
    checks.whole("max_new_tokens", max_new_tokens, minimum=1)
    auto = k == "auto"
    if auto:
        checks.whole("k_max", k_max, minimum=1)
        if costs is None or len(costs) != k_max + 1:
            raise InputError(f"costs: auto needs a round's cost at k = 0..{k_max} (measure_costs), found {costs!r}")
    else:
        checks.whole("k", k, minimum=0)
    most = k_max if auto else k
    if most and not model.config.has_mtp:
        raise InputError("k: this model has no MTP block to draft with (num_nextn_predict_layers = 0)")
    mode = SamplingMode.of(checks.real("temperature", temperature, 0.0), top_k, top_p)
    sampling = SamplingParams(temperature=jnp.float32(temperature or 1.0), top_k=jnp.int32(max(top_k, 1)),
                              top_p=jnp.float32(top_p))
    lengths = np.array([len(p) for p in prompts], np.int32)
    b, width = len(prompts), int(lengths.max())
    prompt = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, :len(p)] = p
    needed = width + (max_new_tokens + 1) * (most + 1) + 1  # rows that are done keep decoding
    max_len = checks.whole("cache_len", cache_len, minimum=needed) if cache_len is not None else needed
    headroom = checks.whole("headroom", headroom, minimum=most + 1) if headroom is not None else most + 1
    c, dtype = model.config, model.dtype
    with model.mesh_context():
        state = prefill(c, dtype, mode, model.params, sampling, jax.random.key(seed), *model.place_rows((prompt, lengths)),
                        model.new_caches(b, max_len, headroom), model.new_mtp_cache(b, max_len, headroom))
    out = [[int(t)] for t in np.asarray(state.token)]
    rounds, counts, chosen = [], AcceptanceCounts.zeros(max(most, 1)), most
    while min(len(row) for row in out) < max_new_tokens:
        if auto and len(rounds) % AUTO_SEGMENT == 0:
            chosen = min(int(best_k(counts, jnp.asarray(costs, jnp.float32))), chosen + 1 if rounds else 1)
        with model.mesh_context():
            state, committed, accepted = run_round(c, dtype, chosen, mode, auto and not chosen, model.params,
                                                   sampling, state)
        committed, accepted = np.asarray(committed), np.asarray(accepted)
        rounds.append((chosen, accepted))
        counts = counts.update(chosen, jnp.asarray(accepted), jnp.ones(b, bool))
        for i, row in enumerate(out):
            row.extend(int(t) for t in committed[i, :accepted[i] + 1])
    return [row[:max_new_tokens] for row in out], rounds


def measure_costs(model: V4Model, batch: int, max_len: int, k_max: int, repeats: int = 5) -> np.ndarray:
    """A greedy round's time at k = 0..k_max (with the MTP repair auto runs) over a plain round's,
    median of `repeats` after a compile, for `batch` rows of caches of max_len -> [k_max + 1]."""
    mode, c, dtype = SamplingMode(), model.config, model.dtype
    sampling = SamplingParams(temperature=jnp.float32(1), top_k=jnp.int32(1), top_p=jnp.float32(1))
    prompt = np.zeros((batch, 8), np.int32)
    state = prefill(c, dtype, mode, model.params, sampling, jax.random.key(0), prompt, np.full(batch, 8, np.int32),
                    model.new_caches(batch, max_len, k_max + 1), model.new_mtp_cache(batch, max_len, k_max + 1))

    def seconds(k, repair):
        jax.block_until_ready(run_round(c, dtype, k, mode, repair, model.params, sampling, state))
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            jax.block_until_ready(run_round(c, dtype, k, mode, repair, model.params, sampling, state))
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    plain = seconds(0, False)
    return np.array([seconds(k, k == 0) / plain for k in range(k_max + 1)])


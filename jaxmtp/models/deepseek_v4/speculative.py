"""Greedy speculative decoding on DeepSeek-V4 with its MTP block, one jitted round at a time.

A row's newest token t_n sits at position n, not yet fed to the model; its first draft d1 came from
the MTP block's slot n - 1 (streams of position n - 1 and the token t_n), and that slot's output
streams are kept to draft further. A round of k:
1. drafts d2..dk: slot n + j - 1 reads the block's own streams of the previous slot and d_j;
2. verifies [t_n, d1..dk] at positions n..n+k in one main forward and accepts the longest run of
   drafts equal to the main model's argmax, plus the main model's next token;
3. repairs the MTP cache at slots n..n+a with the main model's streams and the committed tokens,
   which also drafts the next round's d1.
Caches are stored by position (jaxmtp.models.deepseek_v4.attention), so the rejected drafts'
entries are rolled back by advancing n by a + 1 only. Plain decoding is the k = 0 round.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import checks
from jaxmtp.errors import InputError
from jaxmtp.models.deepseek_v4.model import V4Model
from jaxmtp.models.deepseek_v4.transformer import DeepseekV4
from jaxmtp.speculative import verify_greedy


def _module(config, dtype, params):
    model = DeepseekV4(config, dtype)
    return lambda *args, method=None: model.apply({"params": params}, *args, method=method)


@partial(jax.jit, static_argnums=(0, 1))
def prefill(config, dtype, params, prompt, lengths, caches, mtp_cache):
    """prompt [B, P] right-padded to lengths [B] -> (caches, MTP cache, t_n [B] at position
    lengths, d1 [B], the MTP streams d1 came from [B, 1, N, D]). The MTP block, which attends to
    the sliding window only, is run on the prompt's last sliding_window positions."""
    apply = _module(config, dtype, params)
    b, width = prompt.shape
    logits, _, streams, caches = apply(prompt, jnp.zeros(b, jnp.int32), lengths, caches)
    token = jnp.argmax(jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], -1).astype(jnp.int32)
    seq = jnp.concatenate([prompt, jnp.zeros((b, 1), jnp.int32)], axis=1).at[jnp.arange(b), lengths].set(token)
    span = min(config.sliding_window, width)
    start = jnp.maximum(lengths - span, 0)
    at = jnp.clip(start[:, None] + jnp.arange(span)[None], 0, width - 1)
    window = jnp.take_along_axis(streams, at[:, :, None, None], axis=1)
    nexts = jnp.take_along_axis(seq, at + 1, axis=1)
    mtp_logits, mtp_streams, mtp_cache = apply(window, nexts, start, lengths - start, mtp_cache,
                                               method=DeepseekV4.mtp_step)
    last = (lengths - start - 1)[:, None]
    draft = jnp.argmax(jnp.take_along_axis(mtp_logits, last[..., None], axis=1)[:, 0], -1).astype(jnp.int32)
    recycled = jnp.take_along_axis(mtp_streams, last[..., None, None], axis=1)
    return caches, mtp_cache, token, draft, recycled


@partial(jax.jit, static_argnums=(0, 1, 2))
def greedy_round(config, dtype, k, params, caches, mtp_cache, n, token, draft, recycled):
    """One round of k drafts (0: plain decoding) for every row.
    -> (caches, MTP cache, n, t_n, d1, recycled streams, committed [B, k + 1] (the first a + 1 of
    each row are its new tokens), accepted a [B])."""
    apply = _module(config, dtype, params)
    b = n.shape[0]
    one = jnp.ones(b, jnp.int32)
    drafts, streams = [draft], recycled
    for j in range(1, k):
        logits, streams, mtp_cache = apply(streams, drafts[-1][:, None], n + j - 1, one, mtp_cache,
                                           method=DeepseekV4.mtp_step)
        drafts.append(jnp.argmax(logits[:, 0], -1).astype(jnp.int32))
    drafts = jnp.stack(drafts, axis=1)[:, :k]  # [B, k]
    logits, _, main_streams, caches = apply(jnp.concatenate([token[:, None], drafts], axis=1), n,
                                            one * (k + 1), caches)
    accepted, after = verify_greedy(drafts, logits)
    committed = jnp.concatenate([drafts, after[:, None]], axis=1).at[jnp.arange(b), accepted].set(after)
    if k:
        mtp_logits, mtp_streams, mtp_cache = apply(main_streams, committed, n, accepted + 1, mtp_cache,
                                                   method=DeepseekV4.mtp_step)
        draft = jnp.argmax(jnp.take_along_axis(mtp_logits, accepted[:, None, None], axis=1)[:, 0], -1)
        recycled = jnp.take_along_axis(mtp_streams, accepted[:, None, None, None], axis=1)
    return caches, mtp_cache, n + accepted + 1, after, draft.astype(jnp.int32), recycled, committed, accepted


def generate_greedy(model: V4Model, prompts, max_new_tokens: int, k: int = 0):
    """Greedy decoding of each prompt (no stop tokens) with k drafts per round (0: plain).
    -> (the new tokens of each prompt, drafts accepted per round [rounds, B])."""
    prompts = checks.prompts(prompts, model.config.vocab_size)
    checks.whole("max_new_tokens", max_new_tokens, minimum=1)
    checks.whole("k", k, minimum=0)
    if k and not model.config.has_mtp:
        raise InputError("k: this model has no MTP block to draft with (num_nextn_predict_layers = 0)")
    lengths = np.array([len(p) for p in prompts], np.int32)
    b, width = len(prompts), int(lengths.max())
    prompt = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, :len(p)] = p
    max_len = width + (max_new_tokens + 1) * (k + 1) + 1  # rows that are done keep decoding
    caches, mtp_cache = model.new_caches(b, max_len, k + 1), model.new_mtp_cache(b, max_len, k + 1)
    c, dtype = model.config, model.dtype
    caches, mtp_cache, token, draft, recycled = prefill(c, dtype, model.params, prompt, lengths, caches, mtp_cache)
    out = [[int(t)] for t in np.asarray(token)]
    n, rounds = jnp.asarray(lengths), []
    while min(len(row) for row in out) < max_new_tokens:
        caches, mtp_cache, n, token, draft, recycled, committed, accepted = greedy_round(
            c, dtype, k, model.params, caches, mtp_cache, n, token, draft, recycled)
        committed, accepted = np.asarray(committed), np.asarray(accepted)
        rounds.append(accepted)
        for i, row in enumerate(out):
            row.extend(int(t) for t in committed[i, :accepted[i] + 1])
    return [row[:max_new_tokens] for row in out], np.array(rounds)

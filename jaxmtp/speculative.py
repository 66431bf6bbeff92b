"""Verifying k drafts against the main model's k+1 output rows (docs/speculative_decoding.md, "Exactness").

Greedy: accept the longest prefix of drafts equal to the main model's argmax, then emit the
argmax of the first unmatched row (a correction, or the bonus after all k).
Sampling: standard speculative sampling. Draft i+1 is accepted with probability
min(1, p_i(d) / q_i(d)); on the first rejection the token comes from normalize(max(p_i - q_i, 0));
after k acceptances the bonus comes from p_k. The output then follows p exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.sampling import SamplingMode, SamplingParams, draw, greedy, probabilities, split, uniform


def leading_run(ok: jax.Array) -> jax.Array:
    """ok [B, k] bool -> [B] int32: how many leading entries are True."""
    return jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(axis=-1)


def verify_greedy(drafts: jax.Array, target_logits: jax.Array):
    """drafts [B, k], target_logits [B, k+1, V] -> (accepted count a [B], token after them [B])."""
    best = greedy(target_logits)  # [B, k+1]
    accepted = leading_run(drafts == best[:, :-1])
    return accepted, jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0]


def verify_sampled(key, drafts, draft_probs, target_logits, mode: SamplingMode, params: SamplingParams):
    """drafts [B, k] drawn from draft_probs q [B, k, V]; target_logits [B, k+1, V]. key: one key,
    or one per row [B]. Rows that params.greedy marks are verified greedily (their drafts were the
    MTP layer's argmax).

    Returns (accepted count a [B], token after them [B]).
    """
    p = probabilities(target_logits, mode, params)  # [B, k+1, V]
    take = lambda probs: jnp.take_along_axis(probs, drafts[..., None], axis=-1)[..., 0]  # noqa: E731
    p_draft, q_draft = take(p[:, :-1]), take(draft_probs)  # [B, k]
    accept_key, residual_key = split(key, 2)
    u = uniform(accept_key, drafts.shape)
    accepted = leading_run(u * q_draft <= p_draft)
    residual = jnp.maximum(p[:, :-1] - draft_probs, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # mass 0 means p == q there: every draft is accepted, so the residual is never drawn from.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p[:, :-1])
    candidates = draw(residual_key, jnp.concatenate([residual, p[:, -1:]], axis=1))  # [B, k+1]
    after = jnp.take_along_axis(candidates, accepted[:, None], axis=1)[:, 0]
    if params.greedy is None:
        return accepted, after
    greedy_accepted, greedy_after = verify_greedy(drafts, target_logits)  # the rows that decode greedily
    return jnp.where(params.greedy, greedy_accepted, accepted), jnp.where(params.greedy, greedy_after, after)

"""Choosing tokens from logits: greedy, or sampling after temperature, top-k and top-p.

The same transform gives the target distribution p and the draft distribution q in speculative
sampling, which is what makes it exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """The static shape of the sampling transform (one compile each); the values are traced.

    greedy: argmax of the raw logits (temperature 0); top_k / top_p: whether those filters run.
    """

    greedy: bool = True
    top_k: bool = False
    top_p: bool = False

    @classmethod
    def of(cls, temperature: float, top_k: int, top_p: float) -> "SamplingMode":
        """The mode these settings need: greedy at temperature 0, else which filters apply."""
        if temperature == 0:
            return cls()
        return cls(greedy=False, top_k=top_k > 0, top_p=top_p < 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Traced values: temperature > 0, top_k >= 1 (when used), 0 < top_p <= 1; each a scalar for
    the whole batch, or one per row [B] (the serving engine's slots). greedy [B] (or None): rows
    that take the argmax of the raw logits whatever the others' settings, so that one compiled
    sampling program serves greedy and sampled requests side by side."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    greedy: jax.Array | None = None


def per_row(value: jax.Array, like: jax.Array) -> jax.Array:
    """A scalar or per-row value [B] shaped to broadcast against like [B, ...] (or [...] for a scalar)."""
    value = jnp.asarray(value)
    return value.reshape(value.shape + (1,) * (like.ndim - value.ndim))


def split(key: jax.Array, num: int) -> tuple[jax.Array, ...]:
    """num keys from key: one key, or one key per row [B] (each row's stream its own)."""
    if key.ndim == 0:
        return tuple(jax.random.split(key, num))
    keys = jax.vmap(lambda k: jax.random.split(k, num))(key)  # [B, num]
    return tuple(keys[:, i] for i in range(num))


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform [0, 1) values of `shape`; with one key per row [B], row b's come from key b."""
    if key.ndim == 0:
        return jax.random.uniform(key, shape)
    return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(key)


def probabilities(logits: jax.Array, mode: SamplingMode, params: SamplingParams) -> jax.Array:
    """logits [..., V] -> the sampling distribution [..., V] (float32, sums to 1).

    Temperature scaling, then top-k (keep logits >= the k-th largest), then top-p (keep the most
    probable tokens until their cumulative probability reaches top_p; ties at the edge stay).
    """
    logits = logits.astype(jnp.float32) / per_row(params.temperature, logits)
    if mode.top_k:
        descending = -jnp.sort(-logits, axis=-1)
        index = jnp.broadcast_to(per_row(params.top_k - 1, logits), logits.shape[:-1] + (1,))
        kth = jnp.take_along_axis(descending, index, axis=-1)
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if mode.top_p:
        descending = -jnp.sort(-probs, axis=-1)
        before = jnp.cumsum(descending, axis=-1) - descending  # mass of the more probable tokens
        kept = before < per_row(params.top_p, probs)
        smallest_kept = jnp.min(jnp.where(kept, descending, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs >= smallest_kept, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def greedy(logits: jax.Array) -> jax.Array:
    """logits [..., V] -> jnp.argmax over V [...] int32 (the first of tied maxima, a NaN counted largest).

    Computed as one max and one min reduction because XLA CPU runs argmax's paired value-and-index
    reduction as a scalar loop."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN where a row has one
    hit = (logits == top) | jnp.isnan(logits)
    vocab = logits.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def draw(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per row from probs [..., V] -> [...] int32; with one key per row [B], probs [B, ...,
    V] and row b drawn with key b."""
    if key.ndim == 0:
        return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
    return jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p), axis=-1))(key, probs).astype(jnp.int32)


def choose(key: jax.Array, logits: jax.Array, mode: SamplingMode, params: SamplingParams):
    """Picks a token per row. logits [..., V] -> (tokens [...], the distribution drawn from [..., V],
    or None when greedy)."""
    if mode.greedy:
        return greedy(logits), None
    probs = probabilities(logits, mode, params)
    tokens = draw(key, probs)
    if params.greedy is not None:
        tokens = jnp.where(per_row(params.greedy, tokens), greedy(logits), tokens)
    return tokens, probs


def log_probabilities(logits: jax.Array, mode: SamplingMode, params: SamplingParams) -> jax.Array:
    """logits [..., V] -> the log of the distribution tokens are chosen from [..., V] float32: the
    sampling distribution, or when greedy the model's own softmax (temperature 1)."""
    if mode.greedy:
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    sampled = jnp.log(probabilities(logits, mode, params))
    if params.greedy is None:
        return sampled
    return jnp.where(per_row(params.greedy, logits), jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), sampled)

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
    probable tokens until their cumulative probability reaches top_p; ties at the edge stay). Each
    filter finds its threshold by bisection, without sorting the vocabulary (see `_top_k_kept`,
    `_top_p_kept`), and is skipped where it is off for every row.
    """
    logits = logits.astype(jnp.float32) / per_row(params.temperature, logits)
    vocab = logits.shape[-1]
    if mode.top_k:
        top_k = jnp.clip(per_row(params.top_k, logits), 1, vocab)
        kept = jax.lax.cond(jnp.any(top_k < vocab), _top_k_kept, lambda x, k: jnp.ones(x.shape, bool), logits, top_k)
        logits = jnp.where(kept, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if mode.top_p:
        top_p = per_row(params.top_p, probs)
        kept = jax.lax.cond(jnp.any(top_p < 1), _top_p_kept, lambda x, p: jnp.ones(x.shape, bool), probs, top_p)
        probs = jnp.where(kept, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


# Bisection steps of the filters' thresholds: the float32 values' order keys span 2^32.
_BISECTION_STEPS = 32


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 [...] -> uint32 keys [...] in the values' order (-0.0 as 0.0; NaNs aside)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)  # (XLA folds x + 0.0 to x)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _top_k_kept(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """logits [..., V], top_k (1..V, broadcasting to [..., 1]) -> where logits >= the top_k-th
    largest [..., V] bool: the largest key t with at least top_k keys >= t, found by bisection
    between the row's smallest and largest keys. The threshold is one of the row's own values, so
    the set equals what a descending sort's entry top_k - 1 gives, bit for bit; a sort of the
    vocabulary per row cost XLA CPU 5 to 11 times as much (benchmarks/sampling.py)."""
    keys = _order_keys(logits)

    def step(_, bounds):
        low, high = bounds  # at least top_k keys are >= low, fewer than top_k are > high
        mid = low + (high - low + 1) // 2
        enough = (keys >= mid).sum(axis=-1, keepdims=True) >= top_k
        return jnp.where(enough, mid, low), jnp.where(enough, high, mid - 1)

    bounds = (keys.min(axis=-1, keepdims=True), keys.max(axis=-1, keepdims=True))
    low, _ = jax.lax.fori_loop(0, _BISECTION_STEPS, step, bounds)
    return keys >= low


def _top_p_kept(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """probs [..., V] (>= 0), top_p (0 < top_p, broadcasting to [..., 1]) -> the nucleus [..., V]
    bool: probs >= the smallest value v whose more probable tokens (probs > v) hold less than top_p
    of the mass, found by bisection on the values' bits (a non-negative float's bits order as it
    does). In descending order that v is the last token whose predecessors' cumulative mass is
    below top_p, as a sort and cumulative sum find it (up to the order the mass is summed in)."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

    def step(_, bounds):
        low, high = bounds  # below the answer: low; at or above it: high
        mid = low + (high - low) // 2
        within = jnp.where(bits > mid, probs, 0.0).sum(axis=-1, keepdims=True) < top_p
        return jnp.where(within, low, mid), jnp.where(within, mid, high)

    bounds = (jnp.full(bits.shape[:-1] + (1,), -1, jnp.int32), bits.max(axis=-1, keepdims=True))
    _, high = jax.lax.fori_loop(0, _BISECTION_STEPS, step, bounds)
    return bits >= high


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

"""The sampling transform (jaxmtp.sampling.probabilities) against numpy written from its definition:
temperature, then keep the logits >= the k-th largest, then keep the most probable tokens until
their cumulative probability reaches top_p, ties at either edge kept. Rows carry their own settings,
as the serving engine's slots do, and include ties, -inf logits and signed zeros."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.sampling import SamplingMode, SamplingParams, probabilities
from numpy_reference import sampling_distribution as reference

VOCAB = 300
BOTH = SamplingMode(greedy=False, top_k=True, top_p=True)


def rows(count, seed):
    """Logits [count, VOCAB] with repeated values, some -inf and signed zeros, and per-row settings."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(count, VOCAB)) * rng.uniform(0.5, 4, (count, 1))).astype(np.float32)
    logits = np.round(logits, 1)  # many ties, at the k-th value and in the nucleus's edge
    logits[:, :8] = logits[:, 8:16]
    logits[rng.random((count, VOCAB)) < 0.05] = -np.inf
    logits[:, 16], logits[:, 17] = 0.0, -0.0
    temperature = rng.uniform(0.3, 2.0, count).astype(np.float32)
    top_k = rng.integers(1, VOCAB + 1, count)
    top_p = rng.uniform(0.05, 1.0, count).astype(np.float32)
    if count >= 8:  # the filters' edges
        top_k[:4] = [1, 2, VOCAB, VOCAB - 1]
        top_p[4:8] = [1.0, 1e-6, 0.999, 0.5]
    return logits, temperature, top_k.astype(np.int32), top_p


@pytest.mark.parametrize("mode", [BOTH, SamplingMode(greedy=False, top_k=True), SamplingMode(greedy=False, top_p=True)],
                         ids=["top_k_and_top_p", "top_k", "top_p"])
def test_each_rows_distribution_matches_the_sorted_definition(mode):
    logits, temperature, top_k, top_p = rows(64, seed=0)
    params = SamplingParams(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p))
    got = np.asarray(jax.jit(probabilities, static_argnums=1)(jnp.asarray(logits), mode, params))
    for i in range(len(logits)):
        want = reference(logits[i], temperature[i], top_k[i] if mode.top_k else 0, top_p[i] if mode.top_p else 1.0)
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=f"row {i}: the kept tokens differ")
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-7, err_msg=f"row {i}")


def test_filters_off_in_every_row_keep_the_whole_softmax():
    """top_k = V and top_p = 1 everywhere (the engine's rows without filters): the tempered softmax."""
    logits, temperature, _, _ = rows(8, seed=1)
    params = SamplingParams(jnp.asarray(temperature), jnp.full((8,), VOCAB, jnp.int32), jnp.ones((8,), jnp.float32))
    got = np.asarray(probabilities(jnp.asarray(logits), BOTH, params))
    want = np.stack([reference(logits[i], temperature[i], 0, 1.0) for i in range(8)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_batch_wide_settings_and_extra_axes():
    """Scalar settings over logits [B, T, V] (generate's verify passes): every row filtered alike."""
    logits, _, _, _ = rows(6, seed=2)
    logits = logits.reshape(2, 3, VOCAB)
    params = SamplingParams(jnp.float32(0.7), jnp.int32(40), jnp.float32(0.8))
    got = np.asarray(probabilities(jnp.asarray(logits), BOTH, params))
    for b in range(2):
        for t in range(3):
            want = reference(logits[b, t], 0.7, 40, np.float32(0.8))
            np.testing.assert_array_equal(got[b, t] > 0, want > 0)
            np.testing.assert_allclose(got[b, t], want, rtol=1e-5, atol=1e-7)

"""Speculative sampling is exact: the first three tokens follow the model's own distribution.

The reference distribution comes from full (uncached) forward passes over every possible prefix,
transformed by a numpy temperature / top-k / top-p written from their definitions; the samples come
from 12,288 rows of one `generate` call. A chi-square test compares them.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import generation_models as gm
import jaxmtp
from long_tests import only_long
from numpy_reference import sampling_distribution
from jaxmtp.generation import prepare, unpack

VOCAB = 8
# One dense main layer (the MTP layer has the MoE): the exactness is per token, and a MoE layer's
# prefill over every row made each call 1.5x dearer.
CONFIG = gm.TINY.replace(vocab_size=VOCAB, num_hidden_layers=1)
# The same with DeepSeek Sparse Attention reading 3 keys per query: from the third generated token on,
# the prompt and drafts are more than that, so the indexer's choice shapes every distribution.
V32 = CONFIG.replace(model_type="deepseek_v32", index_n_heads=16, index_head_dim=16, index_topk=3)
PROMPT = [3, 1, 4, 1, 5]
SAMPLES = 12_288  # enough that sampling at temperature 1.25 against 1.0's distribution gives p ~ 1e-126 at k = 2
NEW = 3


def exact_distribution(model, temperature, top_k, top_p):
    """P(t1, t2, t3 | PROMPT) for all VOCAB^3 triples, from full forward passes."""
    pairs = np.array(list(itertools.product(range(VOCAB), repeat=2)))
    tokens = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1)
    logits, _ = model.forward(tokens)
    logits = np.asarray(logits, np.float64)
    n = len(PROMPT)
    t = lambda row: sampling_distribution(row, temperature, top_k, top_p)  # noqa: E731
    probs = np.zeros((VOCAB,) * 3)
    p1 = t(logits[0, n - 1])
    for row, (a, b) in enumerate(pairs):
        probs[a, b] = p1[a] * t(logits[row, n])[b] * t(logits[row, n + 1])
    return probs


def chi_square_p_value(counts, expected):
    """Pearson's test; cells expected below 5 are pooled into one."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("k, temperature, top_k, top_p, config", [
    (0, 1.0, 0, 1.0, CONFIG),   # plain sampling, the baseline the speculative runs must match
    ("auto", 1.0, 0, 1.0, CONFIG),  # the auto loop at k = 2: its segment first re-drafts d1 from the prompt's slots
    (2, 1.0, 3, 1.0, CONFIG),   # the loop at a fixed k = 2; top-k
    (1, 0.8, 0, 0.8, CONFIG),   # k = 1 reaches the bonus token within three tokens; top-p
    # DeepSeek-V3.2's sparse attention in the prefill, drafts and verify passes
    pytest.param(2, 1.0, 0, 1.0, V32, marks=only_long("the same sampling as k2_top_k over V3.2's logits, whose "
                                                      "speculative greedy tokens tests/test_deepseek_v32.py checks")),
], ids=["plain", "auto", "k2_top_k", "k1_top_p", "v32_k2"])
def test_first_three_tokens_follow_the_model(k, temperature, top_k, top_p, config):
    model = gm.model("partial", config, head_scale=0.25)
    sampling = dict(max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=17)
    if k == "auto":  # every round at k = 2 (calibrating costs for this batch would take longer than the test)
        prepared = prepare(model, [PROMPT] * SAMPLES, speculative_k="auto", **sampling)
        out = unpack(prepared, prepared.run(prepared.inputs.replace(force_k=jnp.int32(2))))
    else:
        out = jaxmtp.generate(model, [PROMPT] * SAMPLES, speculative_k=k, **sampling)
    assert all(len(row) == NEW for row in out.tokens)
    counts = np.zeros((VOCAB,) * 3)
    np.add.at(counts, tuple(np.array(out.tokens).T), 1)
    expected = exact_distribution(model, temperature, top_k, top_p) * SAMPLES
    assert expected.sum() == pytest.approx(SAMPLES)
    if top_k:  # nothing outside the top-k is ever produced
        assert counts[expected == 0].sum() == 0
    p_value = chi_square_p_value(counts.ravel(), expected.ravel())
    assert p_value > 1e-3, p_value
    if k:  # both the accept and the reject paths really ran
        assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate

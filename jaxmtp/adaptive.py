"""Choosing k while generating (`speculative_k="auto"`): the expected tokens per unit of time.

A round at k costs `cost[k]` plain steps (measured once per device, model and shape bucket, see
jaxmtp.calibration) and yields 1 + sum_{i<=k} P(drafts 1..i all accepted) tokens. With c_i the
conditional acceptance of draft i (accepted, given that drafts 1..i-1 were), that is
E_k = 1 + sum_{i<=k} prod_{j<=i} c_j, and the rule picks the k in 0..k_max that maximises
E_k / cost[k]. Each c_i is the mean of a Beta posterior over the rounds in which draft i was
tried: a prior worth PRIOR_ROUNDS rounds at PRIOR_ACCEPTANCE, plus the counts of the running call,
which decay by DECAY per round at k > 0 so that the estimate follows acceptance as the text
changes, and by IDLE_DECAY per round at k = 0, which measures nothing: an MTP layer that is
rarely right is tried again after some hundred rounds, not every few dozen, so that drafts that are
never accepted cost little against plain decoding (benchmarks/useless_mtp.py).

Every round is an exact verification whatever its k, so switching k keeps greedy output identical
to plain decoding and sampled output exactly distributed. Rounds at k = 0 draft nothing, measure
nothing and leave the MTP cache as it is; once decay has brought the counts back towards the
prior the rule tries drafting again. A segment at k > 0 after one at k = 0 first runs the MTP
layer over the last AUTO_SEGMENT positions (`decoding.refill_drafts`), which writes their MTP slots (a
segment at k = 0 does not write them) and drafts d1 from the newest one; positions further back that
plain rounds decoded stay empty, so the drafts that attend to them may be accepted less often.
Where no k > 0 pays at the prior's acceptance, the auto loop would never draft, so `generate` runs
the plain loop instead (`drafting_pays`), which is cheaper than the auto loop's own rounds at
k = 0 (benchmarks/auto_k0.py, benchmarks/auto_vs_plain.py). Where drafting pays at the prior, a
call's first segment of AUTO_SEGMENT rounds runs at k = 1; what a model whose drafts are rarely
accepted then pays is that exploring (benchmarks/useless_mtp.py). The
loop raises k by at most one per segment (jaxmtp.decoding._rounds), so a first segment, and a
segment after rounds at k = 0, tries k = 1 whatever k the prior would pay best.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

PRIOR_ACCEPTANCE = 0.7
PRIOR_ROUNDS = 16.0
DECAY = 0.99
IDLE_DECAY = 0.998


@flax.struct.dataclass
class AcceptanceCounts:
    """Batch-wide, decayed counts per draft position i = 1..k_max: tried [k_max] (rounds in which
    draft i was verified, i.e. drafts 1..i-1 were accepted), accepted [k_max]."""

    tried: jax.Array
    accepted: jax.Array

    @classmethod
    def zeros(cls, k_max: int) -> "AcceptanceCounts":
        return cls(jnp.zeros((k_max,), jnp.float32), jnp.zeros((k_max,), jnp.float32))

    def update(self, k: int, accepted: jax.Array, active: jax.Array) -> "AcceptanceCounts":
        """After a round at k: accepted [B] drafts per row, active [B] rows that took part."""
        position = jnp.arange(1, self.tried.shape[0] + 1)
        tried = (position[None] <= jnp.minimum(accepted + 1, k)[:, None]) & active[:, None]
        hit = (position[None] <= accepted[:, None]) & active[:, None]
        decay = DECAY if k else IDLE_DECAY
        return AcceptanceCounts(decay * self.tried + tried.sum(0), decay * self.accepted + hit.sum(0))

    def conditional(self) -> jax.Array:
        """Posterior mean acceptance of each draft given the ones before it [k_max]."""
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_ROUNDS) / (self.tried + PRIOR_ROUNDS)


def expected_tokens(conditional: jax.Array) -> jax.Array:
    """c [k_max] -> E_k [k_max + 1]: tokens per round at k = 0..k_max."""
    reach = jnp.cumprod(conditional)  # P(drafts 1..i accepted)
    return 1.0 + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(reach)])


def best_k(counts: AcceptanceCounts, costs: jax.Array) -> jax.Array:
    """The k in 0..k_max with the most expected tokens per plain step. costs [k_max + 1] -> int32."""
    return jnp.argmax(expected_tokens(counts.conditional()) / costs).astype(jnp.int32)


def drafting_pays(costs) -> bool:
    """Whether at the prior's acceptance some k > 0 yields more tokens per plain step than plain
    decoding does (costs [k_max + 1] in plain steps). Where none does, the auto loop would never
    draft (its counts stay at the prior), so `generate` runs the plain loop instead."""
    expected = _prior_tokens(len(costs) - 1)
    return bool(np.max(expected[1:] / np.asarray(costs[1:], np.float64)) > 1.0)


@functools.cache
def _prior_tokens(k_max: int) -> np.ndarray:
    """E_k [k_max + 1] at the prior's acceptance (`expected_tokens` of empty counts), computed once
    per k_max: generate asks on every call."""
    return np.asarray(expected_tokens(AcceptanceCounts.zeros(k_max).conditional()), np.float64)


def plain_reason(costs) -> str:
    """Why auto decodes plainly at these round costs [k_max + 1] (plain steps), in words."""
    expected = _prior_tokens(len(costs) - 1)
    ks = range(1, len(costs))
    return (f"a round drafting k = {', '.join(map(str, ks))} costs "
            f"{', '.join(f'{costs[k]:.2f}' for k in ks)} plain steps on this machine, and yields "
            f"{', '.join(f'{expected[k]:.2f}' for k in ks)} tokens at the prior acceptance of "
            f"{PRIOR_ACCEPTANCE:.0%}, so no k pays")

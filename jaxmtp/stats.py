"""`GenerationStats`: the counts of a generation run, with the ratios derived from them."""

from __future__ import annotations

import dataclasses

import numpy as np

# The derived figures, every property below: what as_dict writes.
_NAMES = ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "draft_tokens", "accepted_tokens",
          "rounds_by_k", "main_forward_passes", "per_row", "round_costs", "chose_plain")


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """Raw counts, one entry per row: rounds (verify rounds the row ran), drafted and accepted
    (draft tokens), accepted_at[row][i] (rounds in which draft i+1 was accepted), rounds_at[row][k]
    (rounds run at k). steps: main forward passes of the batch, the prefill's included.
    round_costs: with speculative_k="auto", the calibrated cost of a round of the auto loop at
    k = 0.. in steps of the plain loop (else None). chose_plain: auto ran the plain loop, because
    at these costs no k > 0 pays at the prior's acceptance (jaxmtp.adaptive.drafting_pays).
    The ratios are properties (`stats.acceptance_rate`); as_dict writes them all."""

    rounds: tuple[int, ...]
    drafted: tuple[int, ...]
    accepted: tuple[int, ...]
    accepted_at: tuple[tuple[int, ...], ...]
    rounds_at: tuple[tuple[int, ...], ...]
    steps: int
    round_costs: tuple[float, ...] | None = None
    chose_plain: bool = False

    @classmethod
    def of(cls, rounds, drafted, accepted, accepted_at, rounds_at, steps, round_costs=None,
           chose_plain=False) -> "GenerationStats":
        """From the loop's arrays ([rows], [rows, k], [rows, k + 1], scalar)."""
        rows = lambda a: tuple(tuple(int(v) for v in r) for r in np.asarray(a))  # noqa: E731
        return cls(tuple(int(v) for v in rounds), tuple(int(v) for v in drafted), tuple(int(v) for v in accepted),
                   rows(accepted_at), rows(rounds_at), int(steps),
                   None if round_costs is None else tuple(float(c) for c in round_costs), bool(chose_plain))

    @property
    def draft_tokens(self) -> int:
        return sum(self.drafted)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify round: 1 + accepted / rounds."""
        rounds = sum(self.rounds)
        return 1 + self.accepted_tokens / rounds if rounds else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """[i]: the share of the rounds that drafted i+1 or more tokens in which draft i+1 was accepted."""
        rounds_at = np.sum(self.rounds_at, axis=0, dtype=np.int64)
        accepted_at = np.sum(self.accepted_at, axis=0, dtype=np.int64).reshape(-1)
        drafting = rounds_at[::-1].cumsum()[::-1][1:]
        return [float(a / d) if d else 0.0 for a, d in zip(accepted_at, drafting)]

    @property
    def rounds_by_k(self) -> dict[int, int]:
        """{k: rounds run at k}, for the k that ran."""
        return {k: int(r) for k, r in enumerate(np.sum(self.rounds_at, axis=0, dtype=np.int64)) if r}

    @property
    def main_forward_passes(self) -> int:
        return self.steps

    @property
    def per_row(self) -> list["GenerationStats"]:
        """Each row's own stats (its passes: the prefill plus the rounds it was still running)."""
        return [GenerationStats((r,), (d,), (a,), (at,), (rk,), 1 + r, self.round_costs, self.chose_plain)
                for r, d, a, at, rk in zip(self.rounds, self.drafted, self.accepted, self.accepted_at, self.rounds_at)]

    def as_dict(self) -> dict:
        """The derived figures as plain values (JSON-ready), per_row included."""
        return {**self._figures(), "per_row": [row._figures() for row in self.per_row]}

    def _figures(self) -> dict:
        out = {name: getattr(self, name) for name in _NAMES if name not in ("per_row", "round_costs")}
        return {**out, "round_costs": None if self.round_costs is None else list(self.round_costs)}

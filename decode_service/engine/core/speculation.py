"""`--mtp-depth auto`: the drafts per step by batch size, from measured step costs and an acceptance-rate table.

A round of B speculating sequences at depth D costs `verify(B, D) + chain(B, D)` (the trunk step over D+1 rows
per sequence, then the drafter's round) and emits `1 + sum(rates[:D])` tokens per sequence on average, `rates[k]`
being the cumulative acceptance of draft position k+1 (the published rates are cumulative: a run of accepted
drafts is a prefix). D = 0 is the plain decode step. Per batch bucket the chooser takes the D that maximises
tokens per second, `(1 + sum(rates[:D])) / (verify + chain)`; a batch runs at its bucket's depth. At B = 1 every
depth re-reads the lm_head, so few depths pay; at larger B the trunk step grows and more depths pay.

No torch here: the costs are measured by the data plane (`worker/calibrate.measure_speculation_costs`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """Measured milliseconds of one bucket: `plain` the decode step without drafts, `verify[D-1]` the step
    verifying D drafts per sequence, `chain[D-1]` the drafter's round drafting D tokens."""

    plain: float
    verify: tuple[float, ...]
    chain: tuple[float, ...]

    def round_ms(self, depth: int) -> float:
        return self.plain if depth == 0 else self.verify[depth - 1] + self.chain[depth - 1]


def expected_tokens(depth: int, rates: tuple[float, ...]) -> float:
    """Tokens one round emits per sequence on average: the bonus token plus the accepted drafts."""
    return 1.0 + sum(rates[:depth])


def best_depth(costs: StepCosts, rates: tuple[float, ...]) -> int:
    """The depth (0 = no speculation) with the most expected tokens per millisecond."""
    depths = range(min(len(costs.verify), len(costs.chain), len(rates)) + 1)
    return max(depths, key=lambda d: (expected_tokens(d, rates) / costs.round_ms(d), -d))


@dataclass(frozen=True)
class DepthTable:
    """The chosen depth of every batch bucket (ascending buckets; a batch takes the smallest bucket >= it)."""

    buckets: tuple[int, ...]
    depths: tuple[int, ...]
    costs: tuple[StepCosts, ...]
    rates: tuple[float, ...]

    @classmethod
    def choose(cls, costs: dict[int, StepCosts], rates: tuple[float, ...]) -> DepthTable:
        buckets = tuple(sorted(costs))
        return cls(
            buckets, tuple(best_depth(costs[b], rates) for b in buckets), tuple(costs[b] for b in buckets), rates
        )

    def depth_for(self, batch: int) -> int:
        i = min(bisect.bisect_left(self.buckets, batch), len(self.buckets) - 1)
        return self.depths[i]

    def lines(self) -> list[str]:
        """One line per bucket: the chosen depth, its expected speedup over the plain step, and the costs."""
        out = []
        for bucket, depth, c in zip(self.buckets, self.depths, self.costs, strict=True):
            gain = expected_tokens(depth, self.rates) / c.round_ms(depth) * c.plain
            rounds = " ".join(f"D={d}:{c.round_ms(d):.2f}" for d in range(1, len(c.verify) + 1))
            out.append(f"B<={bucket}: D={depth} (~{gain:.2f}x tokens/s) plain {c.plain:.2f} ms, rounds {rounds} ms")
        return out

"""Dynamic sampling (DAPO): keep only groups whose rewards are not all equal (all-correct or
all-wrong groups have zero advantage and carry no gradient), and refill the batch by sampling more
prompts, with a cap on the number of extra generation rounds. An extra round is sized by the rate
at which the step's groups have been kept so far, so that one extra round usually fills the batch:
each round costs a whole decode (its latency is its longest response), where a round sized by the
missing groups alone took 3 extra rounds at most steps once fewer than half the groups were kept.

`DynamicSampler` is pure bookkeeping; the loop calls `need()` for how many prompts to generate in
the next round and `add(groups)` with the generated groups."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


MIN_KEPT_RATE = 0.25
"""The kept rate an extra round is sized by when fewer groups than this have been kept: a round
after a first one that kept next to nothing stays within 4x the missing groups (times the factor)."""


def group_is_informative(rewards: list[float]) -> bool:
    """A group teaches something iff its rewards are not all equal."""
    return max(rewards) != min(rewards)


@dataclass
class DynamicSampler:
    target: int
    """Groups wanted for training."""
    max_extra_rounds: int
    """Generation rounds allowed after the first."""
    oversample_factor: float = 1.0
    """Extra rounds sample ceil(missing / kept rate * factor) prompts (`need`)."""
    enabled: bool = True
    """Off: every group of the first round is kept."""
    kept: list = field(default_factory=list)
    rounds: int = 0
    seen: int = 0

    def need(self) -> int:
        """Prompts to generate in the next round (0: done): the target in the first; then the missing
        groups over the rate at which groups have been kept so far (at least MIN_KEPT_RATE), times
        the factor's margin."""
        if self.rounds == 0:
            return self.target
        if not self.enabled or len(self.kept) >= self.target or self.rounds > self.max_extra_rounds:
            return 0
        rate = max(len(self.kept) / self.seen, MIN_KEPT_RATE)
        return math.ceil((self.target - len(self.kept)) / rate * self.oversample_factor)

    def add(self, groups: list, rewards: list[list[float]]) -> None:
        """File one round's groups (with each group's rewards)."""
        self.rounds += 1
        self.seen += len(groups)
        for g, r in zip(groups, rewards):
            if len(self.kept) < self.target and (not self.enabled or group_is_informative(r)):
                self.kept.append(g)

    @property
    def kept_fraction(self) -> float:
        """Kept groups / generated groups."""
        return len(self.kept) / self.seen if self.seen else 0.0

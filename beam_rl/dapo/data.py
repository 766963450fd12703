"""Deterministic data order: an epoch-seeded permutation of the training problems and a cursor
(its whole state is (epoch, position); part of every checkpoint)."""

from __future__ import annotations

import random


class DataOrder:
    def __init__(self, size: int, seed: int, epoch: int = 0, position: int = 0):
        if size < 1:
            raise ValueError("the training split is empty")
        self.size, self.seed, self.epoch, self.position = size, seed, epoch, position

    def _perm(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
            k = min(n - len(out), self.size - self.position)
            out += self._perm(self.epoch)[self.position : self.position + k]
            self.position += k
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def sampling_seed(run_seed: int, step: int, round_: int, index: int) -> int:
    """vLLM per-request seed of sample `index` of generation round `round_` at `step`."""
    return (run_seed * 1_000_003 + step * 100_019 + round_ * 10_007 + index) % (2**31 - 1)


def eval_seed(run_seed: int, index: int) -> int:
    """Held-out evaluation seeds are the same at every evaluation (curves compare like with like)."""
    return (run_seed * 7_919 + 5_000_011 + index) % (2**31 - 1)

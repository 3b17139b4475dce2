"""The run's seeds and the order its prompts come in: what makes a rerun, or a resumed run, draw the same."""

from __future__ import annotations

import random

import torch


class PromptOrder:
    """Which problem comes at each position: a seeded shuffle per epoch, so a position alone decides it."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError("No problems to train on: the dataset is empty.")
        self.n, self.seed = n, seed
        self._epochs: dict[int, list[int]] = {}

    def indices(self, position: int, count: int) -> list[int]:
        return [self._epoch(p // self.n)[p % self.n] for p in range(position, position + count)]

    def _epoch(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            order = list(range(self.n))
            random.Random(mix_seed(self.seed, epoch)).shuffle(order)
            self._epochs[epoch] = order
        return self._epochs[epoch]


def mix_seed(seed: int, *counters: int) -> int:
    """One seed per (run seed, counter, ...): a stream per step, epoch or process that a rerun draws again, and
    that two runs with different seeds do not share. Below 2**31 - 1, which every sampler accepts."""
    for c in counters:
        seed = seed * 1_000_003 + int(c)
    return seed % (2**31 - 1)


def seed_everything(seed: int) -> None:
    """torch, python `random` and numpy (if installed) from one seed: what a fresh run starts from."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass

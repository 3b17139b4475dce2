"""The run's seeds and the order its prompts come in: what makes a rerun, or a resumed run, draw the same."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
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
    """One seed per (run seed, counter, ...), below 2**31 - 1: a stream a rerun draws again, another run does not."""
    for c in counters:
        seed = seed * 1_000_003 + int(c)
    return seed % (2**31 - 1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def capture_rng() -> dict[str, Any]:
    """torch (CPU and CUDA), python and numpy RNG states: what a checkpoint of a step's end restores."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])

"""The reward notebooks 04 and 05 train a random CI-size model on: one every group varies on from step 1."""

from __future__ import annotations

import string


def lowercase_reward(completions: list[str], answers: list[str]) -> list[float]:
    """Share of lowercase ASCII letters in a completion. A random model (CI's `llama-tiny-random`) writes a share of
    0.2-0.3, with spread, so its groups have nonzero advantages from step 1 and the updates move the weights: what
    off-policy needs, and a reward such a model can move within a dozen steps (04 at CI size)."""
    return [sum(ch in string.ascii_lowercase for ch in c) / max(1, len(c)) for c in completions]

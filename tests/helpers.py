"""Helpers several test modules share (test modules never import each other): a teacher-forced reference for
sampling logprobs; the GRPO loop on the tiny model with its metrics and weights compared; the notebooks' names
and a headless browser for the executed notebooks and the book."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch

from cbkit.models.load import load_policy
from cbkit.rollout import Completion, SamplingParams
from cbkit.tasks.data import Problem
from cbkit.train.config import CBGRPOConfig, read_recipe
from cbkit.train.grpo import GRPOTrainer


def teacher_forced_logprobs(model, c: Completion, sampling: SamplingParams) -> torch.Tensor:
    """Log-probs of a completion's tokens under the processed distribution: the package's one teacher-forced forward
    (`cbkit.train.logprobs`), which tests/test_logprobs.py checks against a right-padded forward written by hand."""
    from cbkit.train.logprobs import teacher_forced_logprobs as forward

    return forward(model, [c], sampling)[0].to(model.device)


def max_logprob_diff(model, rollout, sampling: SamplingParams) -> float:
    worst = 0.0
    for c in rollout.completions:
        ref = teacher_forced_logprobs(model, c, sampling)
        got = torch.tensor(c.sampling_logprobs, device=ref.device)
        worst = max(worst, (got - ref).abs().max().item())
    return worst


def rounding_bound(model, completions, temperature: float, dtype: torch.dtype) -> float:
    """How far two forwards of the same weights may put a token's logprob apart when one computes in ``dtype``
    (half-precision weights, or a bf16 autocast over fp32 ones) and the other in fp32 or in ``dtype`` with other
    kernels. Each sub-layer's update to the residual stream is computed from a ``dtype`` copy of its input and comes
    out rounded to ``dtype`` (2 per layer), and the logits are rounded once: 2L + 1 roundings, each within eps
    (``torch.finfo(dtype).eps``) relative to the scale of the values, at most the largest |logit| / temperature Z that
    the sampler saw (a plain forward of ``model``, whose weights must be the ones that sampled). A logit then moves by
    at most (2L + 1) eps Z, and a log-softmax by at most twice its inputs' largest change (the token's logit and the
    log-sum-exp): 2 (2L + 1) eps Z. A wrong temperature, a token scored at the wrong position or another token's
    logprob miss it by nats."""
    scale = 0.0
    for c in completions:
        ids = torch.tensor([list(c.prompt_ids) + list(c.completion_ids)], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1: len(ids[0]) - 1]
        scale = max(scale, logits.float().abs().max().item())
    layers = model.config.num_hidden_layers
    return 2 * (2 * layers + 1) * torch.finfo(dtype).eps * scale / temperature


def cb_forward_returns_its_cache(model, tokenizer) -> bool:
    """Whether the installed transformers' CB engine gets its `PagedAttentionCache` back among the model forward's
    outputs: the object accelerate's bf16 wrapper (`convert_outputs_to_fp32`) calls `.float()` on. Asked of
    transformers' own `generate_batch` (what TRL calls), one 2-token greedy request: 5.24.0 does, 5.17.0 does not."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    seen: list[bool] = []

    def hook(module, args, out):
        seen.append(any(isinstance(v, PagedAttentionCache) for v in out.values()))

    handle = model.register_forward_hook(hook)
    try:
        model.generate_batch(inputs=[tokenizer("hi")["input_ids"]], progress_bar=False,
                             generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
                             continuous_batching_config=ContinuousBatchingConfig(num_blocks=8))
    finally:
        handle.remove()
    assert seen, "generate_batch ran no forward"
    return any(seen)


# --- the GRPO loop on the tiny model --------------------------------------------------------------------------

MAX_LEN = 8
PROBLEMS = [Problem(f"p{i}", q, "1") for i, q in enumerate(["hi", "what is 2+2?", "ok", "go on"])]
# Not deterministic across runs or machines: left out when comparing a resumed run's metrics.
TIMING = ("rollout/seconds", "rollout/tokens_per_s", "rollout/peak_mem_bytes", "train/seconds", "step/seconds",
          "train/prepare_seconds", "train/update_seconds")


def letters_reward(completions: list[str], answers: list[str]) -> list[float]:
    """Share of lowercase ASCII letters: ~1 in 10 tokens of the random tiny model, so groups differ from step 1."""
    return [sum(ch in string.ascii_lowercase for ch in c) / MAX_LEN for c in completions]


def config(**kw) -> CBGRPOConfig:
    base = dict(model="tiny", system_prompt=None, prompts_per_step=2, num_generations=4,
                max_completion_length=MAX_LEN, learning_rate=1e-2, max_steps=2, disable_tqdm=True,
                use_transformers_continuous_batching=False, save_steps=0)
    return CBGRPOConfig(**{**base, **kw})


def recipe(path) -> CBGRPOConfig:
    """A run recipe as `cbkit train --config` reads it: the YAML TRL's `TrlParser --config` reads too."""
    return CBGRPOConfig.from_dict(read_recipe(path))


def trainer(cfg: CBGRPOConfig, policy=None, reward_funcs=(letters_reward,), **kw) -> GRPOTrainer:
    policy = policy if policy is not None else load_policy("tiny", seed=0)
    return GRPOTrainer(cfg, policy=policy, reward_funcs=list(reward_funcs), problems=PROBLEMS, **kw)


def untimed_metrics(path) -> list[dict]:
    """A run's metrics.jsonl rows without the timing keys (``TIMING``)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the notebooks, and a headless browser to open them in -----------------------------------------------------

NOTEBOOK_STEMS = ["00_quickstart", "01_kv_slot_recycling", "02_logprob_correctness", "03_n_sweep", "04_grpo_live",
                  "05_off_policy"]
PLOTLY_JSON = "application/vnd.plotly.v1+json"


def chromium() -> str:
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("this check opens pages in a browser, but no Chromium is installed: apt-get install -y chromium "
                "(.ci/run does).")


def browser(url: str, *args: str) -> str:
    import subprocess
    import tempfile

    # No network: a figure that needs a CDN stays blank here, as it would for an offline reader. Each call gets a
    # profile of its own: Chromium hands a URL to a browser already running on the same profile, and one still
    # shutting down from the call before took it and never answered (a CI run: 04's screenshot idle for 5 minutes,
    # right after its DOM dump; the same command alone takes 2 s). A call gets 120 s and, timed out, one more try.
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(prefix="cbkit-chromium-") as profile:
            cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                   "--hide-scrollbars", "--proxy-server=127.0.0.1:9", "--run-all-compositor-stages-before-draw",
                   "--virtual-time-budget=60000", f"--user-data-dir={profile}", *args, url]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                break
            except subprocess.TimeoutExpired:
                if attempt == 2:
                    raise
    assert done.returncode == 0, f"chromium failed on {url}: {done.stderr[-2000:]}"
    return done.stdout


def drawn_figures(dom: str) -> tuple[int, int]:
    """(plotly figures in the page, those that drew axes and at least one trace) from a DOM Chromium rendered."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(dom, "html.parser")
    figures = soup.select("div.js-plotly-plot")
    drawn = [f for f in figures if f.select("svg.main-svg")
             and (f.select("g.trace") or f.select("g.hm") or f.select("canvas.gl-canvas-context"))]
    return len(figures), len(drawn)


def weight_change(before: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, float]:
    """How far an update moved the weights: the share of weight elements that changed at all, and the
    relative norm of the change. ``before`` is a ``state_dict`` copy taken before the update."""
    changed = total = 0
    diff_sq = base_sq = 0.0
    for name, after in model.state_dict().items():
        if name not in before or not after.is_floating_point():
            continue
        old = before[name].to(after.device)
        changed += int((after != old).sum())
        total += after.numel()
        diff_sq += float((after.double() - old.double()).pow(2).sum())
        base_sq += float(old.double().pow(2).sum())
    if not total:
        raise ValueError("no floating-point weight in common between `before` and the model.")
    return {"changed_share": changed / total, "relative_change": (diff_sq / base_sq) ** 0.5 if base_sq else 0.0}

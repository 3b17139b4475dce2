"""The training step's memory beside the rollout: what one forward and its backward hold (`training_bytes`,
`activation_bytes_per_token`) and the peak of a whole GRPO step, the largest of its phases (`step_peak_bytes`)."""

from __future__ import annotations

from typing import Any

from cbkit.measure.fitted import CPU_CHUNK_HEAP_SLACK
from cbkit.measure.roofline import Shape

# fp32 master weights, their gradients and AdamW's two moments: 4 + 4 + 8 bytes a parameter.
TRAIN_STATE_BYTES_PER_PARAM = 16


def training_bytes(params: int, *, micro_batch_rows: int, tokens_per_row: int, completion_len: int, config: Any,
                   autocast: bool, chunk_rows: int | None = None) -> dict[str, int]:
    """What a training step holds at once, by part: the optimizer state (16 bytes a parameter), one forward's
    loss logits (`cbkit.train.batch.logits_bytes`) and its saved activations (`activation_bytes_per_token` for each
    of its rows x ``tokens_per_row`` tokens). A forward is the micro-batch, or `chunk_rows` of its rows (the loop's
    `forward_chunk_rows`: each chunk is back-propagated before the next is forwarded). An estimate: the loop's
    other buffers are not counted."""
    from cbkit.train.batch import logits_bytes

    rows = micro_batch_rows if chunk_rows is None else min(chunk_rows, micro_batch_rows)
    s = Shape.of(config)  # roofline's reading of the widths and layers (text config included)
    parts = {"optimizer_state": TRAIN_STATE_BYTES_PER_PARAM * params,
             "logits": logits_bytes(rows, completion_len, s.vocab),
             "activations": rows * tokens_per_row * activation_bytes_per_token(config, tokens_per_row, autocast)}
    return {**parts, "total": sum(parts.values())}


def activation_bytes_per_token(config: Any, tokens_per_row: int, autocast: bool) -> int:
    """What autograd keeps for the backward per token of a training forward, all decoder layers, in transformers'
    Llama-family layer with SDPA and a padding mask (the loop's teacher-forced forward). Counted tensor by tensor
    (``torch.autograd.graph.saved_tensors_hooks``; a test repeats the count on the
    tiny model), per token and layer: each of the two RMSNorms keeps its input, the normalised input and its output
    (3 x hidden each); the attention keeps q, k and v as SDPA gets them (k and v repeated to every query head: with
    a mask transformers does not take SDPA's GQA path), SDPA's output and log-sum-exp (one a head), and its float
    mask (one a key position: ``tokens_per_row``); the gated MLP keeps the gate and up projections, SiLU(gate) and
    their product (4 x intermediate). The final norm's 3 x hidden is added once. Elements of 4 bytes (fp32
    weights, no autocast) or 2 (autocast: its norms stay fp32, so this is the lower side).

    Korthikanti et al.'s 34 x hidden bytes a token and layer (GPT's layer, 16-bit; doubled for fp32) is a fifth short
    of this count on SmolLM2-135M: SwiGLU keeps four intermediate-wide tensors where GPT's GeLU MLP keeps two, and
    the attention keeps k and v at the query heads' width."""
    s = Shape.of(config)
    attention = 4 * s.heads * s.head_dim + s.heads + tokens_per_row
    per_layer = 6 * s.hidden + attention + 4 * s.intermediate
    return (2 if autocast else 4) * (s.layers * per_layer + 3 * s.hidden)


# fp32 gradients (4 bytes a parameter) and AdamW's two fp32 moments (8): what an update adds beside the weights.
GRAD_BYTES_PER_PARAM, ADAM_BYTES_PER_PARAM = 4, 8


# The backward on a CPU: every chunk's activations are freed to glibc's heap and stay resident, and the next chunk,
# of another width, fits only partly into their holes, so the floor under each backward rises over the first chunks
# and levels off: the plan adds `fitted.CPU_CHUNK_HEAP_SLACK` x one chunk's part, CPU only.


def step_peak_bytes(params: int, *, rollout_peak_bytes: int, micro_batch_rows: int, chunk_rows: int | None,
                    tokens_per_row: int, completion_len: int, config: Any, autocast: bool,
                    optimizer_state_resident: bool = False, device: str = "cuda",
                    later_tokens_per_row: int | None = None, later_completion_len: int | None = None) -> dict[str, int]:
    """The peak one GRPO step holds above its loaded weights, and the phase that sets it.

    The phases come one after another, so the peak is the largest of them, not their sum: the rollout's own peak
    (the planner's KV and logits for the backend, `plan`); the backward of one forward (the gradients, which live
    from the first backward to the update, plus one chunk's logits and activations, `training_bytes`); and the
    optimizer step (the gradients beside AdamW's two moments). From the second forward of an update on, every
    gradient already exists when a backward starts, and the LM head's weight gradient (vocabulary x hidden, fp32)
    is computed whole beside the activations before it is added to its ``.grad``: the backward holds that too. With
    `optimizer_state_resident` (every step of a run after the first) the moments are held through the whole step;
    without (a fresh trainer, as the full-step sweep builds for every run) they appear at the update. The
    old-logprob forward keeps no activations. On a CPU (``device="cpu"``) with more than one forward, the backward
    adds the heap its earlier chunks leave resident (``CPU_CHUNK_HEAP_SLACK`` x one chunk's part); never on a GPU.

    ``tokens_per_row`` and ``completion_len`` are the widest row's. The trainer forwards a micro-batch's rows longest
    first (`batch.longest_first_chunks`), so where the rows' lengths are known (a replayed workload), ``later_tokens_per_row`` and
    ``later_completion_len`` give the widest row after the first chunk: the backwards that hold every gradient are
    planned at that width, the first backward at the widest. None: every chunk as wide as the first (the plan made
    before a rollout, when any completion may run to the limit)."""
    def chunk_bytes(tokens: int, completion: int) -> int:
        train = training_bytes(params, micro_batch_rows=micro_batch_rows, tokens_per_row=tokens,
                               completion_len=completion, config=config, autocast=autocast, chunk_rows=chunk_rows)
        return train["logits"] + train["activations"]

    grads, moments = GRAD_BYTES_PER_PARAM * params, ADAM_BYTES_PER_PARAM * params
    resident = moments if optimizer_state_resident else 0
    s = Shape.of(config)
    first = chunk_bytes(tokens_per_row, completion_len)
    backward = grads + first + resident
    forwards = 1 if chunk_rows is None else -(-micro_batch_rows // chunk_rows)
    if forwards > 1:
        later = first if later_tokens_per_row is None else chunk_bytes(
            min(later_tokens_per_row, tokens_per_row), min(later_completion_len or completion_len, completion_len))
        chunk = later + GRAD_BYTES_PER_PARAM * s.vocab * s.hidden
        slack = int(CPU_CHUNK_HEAP_SLACK * chunk) if device == "cpu" else 0
        backward = max(backward, grads + chunk + slack + resident)
    parts = {"rollout": rollout_peak_bytes + resident,
             "backward": backward,
             "optimizer_step": grads + moments}
    return {**parts, "peak": max(parts.values())}

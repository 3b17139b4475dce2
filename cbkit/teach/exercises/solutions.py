"""The facilitator's answers, written as a learner would: each has its notebook stub's signature and docstring
(tests/test_exercises.py compares them) and is self-contained, so the solutions book can show its source. The
checks grade them against the kit's own code exactly as they grade a learner's."""

from __future__ import annotations


def format_score(completion: str) -> float:
    """The format reward of one completion: 1.0 when its last non-empty line is `#### <number>` and that is its
    only answer line; 0.5 when `#### <number>` appears anywhere else; 0.0 otherwise.

    `#### <number>` means four hashes, optional spaces, then a number (an optional minus sign, then a digit):
    `#### Step 1` is a heading, not an answer. For the full reward the last line holds the answer and nothing else.
    Special tokens left at the end of decoded text (`<|im_end|>`, `</s>`) are not part of the last line.
    """
    import re

    answer = re.compile(r"####\s*-?\d")
    text = re.sub(r"(\s*(<\|[^|<>]*\|>|</s>))+\s*$", "", completion)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last_is_answer = bool(lines) and re.fullmatch(r"####\s*-?\d+(\.\d+)?", lines[-1]) is not None
    if last_is_answer and len(answer.findall(completion)) == 1:
        return 1.0
    return 0.5 if answer.search(completion) else 0.0


def padding_share(prompt_lens: list[int], completion_lens: list[int]) -> float:
    """The share of a static batch's KV token slots that hold padding, for one row per (prompt, completion).

    `generate()` left-pads every prompt to the longest and keeps every row until the longest completion ends, so
    it allocates rows x (longest prompt + longest completion) slots; each row's useful ones are its own prompt and
    completion tokens.
    """
    slots = len(prompt_lens) * (max(prompt_lens) + max(completion_lens))
    return 1 - (sum(prompt_lens) + sum(completion_lens)) / slots


def schedule_step(candidates: list[tuple[str, int, int, bool]], token_budget: int, read_budget: int,
                  max_requests: int) -> list[tuple[str, int]]:
    """One step of transformers' FIFO scheduler: the requests it schedules, with their query tokens, in order.

    `candidates` are (request_id, past_len, wants, fits) in the engine's order: decoding requests first, then
    prefilling ones, then waiting ones. `past_len` is the KV the request already has (what it will read), `wants`
    the tokens it brings (1 when decoding, the rest of its prompt when prefilling), `fits` whether the cache can
    give the blocks its tokens need. Walk the candidates in order: skip one whose `past_len` is more than the read
    budget left, or that does not fit; otherwise schedule it with min(wants, token budget left) tokens, and take
    those from the token budget and its `past_len` from the read budget. Stop after a scheduled request once the
    token budget is 0, the read budget is <= 0, or `max_requests` are scheduled.
    """
    batch = []
    for request_id, past_len, wants, fits in candidates:
        if past_len > read_budget or not fits:
            continue
        query = min(wants, token_budget)
        batch.append((request_id, query))
        token_budget -= query
        read_budget -= past_len
        if token_budget == 0 or read_budget <= 0 or len(batch) == max_requests:
            break
    return batch


def token_is_weights(old, sampled, mask, clip_max: float):
    """Per-token truncated importance-sampling weights, [B, T]: rho = exp(old - sampled) for each completion token,
    truncated to at most `clip_max` (no lower clip).

    `old` are the training forward's logprobs of the sampled tokens, `sampled` the rollout engine's, `mask` is True
    on completion tokens; only those positions are graded.
    """
    import torch

    return torch.exp(old - sampled).clamp(max=clip_max) * mask


def sequence_mask_weights(old, sampled, mask, clip_max: float):
    """One importance-sampling weight per completion, [B]: the sequence's ratio rho = exp(sum over its tokens of
    (old - sampled)), or 0 when rho is above `clip_max` (masked, not truncated). Padding (mask False) counts for
    nothing.
    """
    import torch

    rho = torch.exp(((old - sampled) * mask).sum(dim=-1))
    return torch.where(rho > clip_max, torch.zeros_like(rho), rho)


def static_kv_bytes(config, rows: int, prompt_len: int, max_new_tokens: int, dtype_bytes: int) -> int:
    """Bytes of KV cache a static batch of `rows` rows holds at its end: every row at prompt_len + max_new_tokens.

    From the model's config: `num_hidden_layers`, `num_key_value_heads`, `head_dim` (None: hidden_size /
    num_attention_heads), `sliding_window` (None, or the most tokens a sliding layer keeps) and `layer_types` (None:
    every layer slides when there is a window; else one "full_attention" / "sliding_attention" per layer).
    """
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    per_layer_token = 2 * config.num_key_value_heads * head_dim * dtype_bytes  # K and V
    length = prompt_len + max_new_tokens
    kinds = config.layer_types or (["sliding_attention" if config.sliding_window else "full_attention"]
                                   * config.num_hidden_layers)
    tokens = sum(min(length, config.sliding_window) if kind == "sliding_attention" else length for kind in kinds)
    return rows * tokens * per_layer_token


def group_advantages(rewards, num_generations: int):
    """GRPO's advantages for rewards laid out group after group, [B]: each reward minus its group's mean, divided by
    the group's sample standard deviation (Bessel-corrected) plus 1e-4."""
    groups = rewards.view(-1, num_generations)
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)
    return adv.flatten()


def aggregate_loss(loss, mask, loss_type: str, max_completion_length: int) -> float:
    """The scalar loss from the per-token loss [B, T] and the completion mask [B, T], for one micro-batch:

    grpo:    the mean over sequences of (the sequence's summed loss / its token count, at least 1)
    bnpo:    summed loss / the batch's token count
    dr_grpo: summed loss / (B x max_completion_length)
    dapo:    summed loss / the token count of the optimizer step (one micro-batch here: the batch's)
    """
    m = mask.float()
    total = (loss * m).sum()
    if loss_type == "grpo":
        return ((loss * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)).mean().item()
    if loss_type in ("bnpo", "dapo"):
        return (total / m.sum().clamp(min=1)).item()
    return (total / (loss.shape[0] * max_completion_length)).item()  # dr_grpo


def fresh_groups(group_versions: list[list[list[int]]], now: int, max_staleness: int) -> list[int]:
    """The indices of the groups async GRPO keeps: those whose every token is at most `max_staleness` updates older
    than `now`. `group_versions[g][c]` lists the policy version of each token of completion c of group g."""
    return [g for g, group in enumerate(group_versions)
            if all(now - v <= max_staleness for completion in group for v in completion)]

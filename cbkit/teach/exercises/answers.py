"""The facilitator's answer key to each notebook's open Questions, shown in the solutions book under its Questions.

A Question asks the learner to edit a cell, rerun and explain what moved (scripts/question_edits.py holds each
edit, `make test-questions` runs them). Each answer says what the edit shows and why, and which printed line,
metric or figure to compare before and after. None states the number a rerun will print: that is the run's to say
(a result typed ahead is a claim the run may contradict), so where the answer depends on a measurement it names
what to compare and which way the mechanism pushes it.

`ANSWERS[stem][i]` answers Question i + 1 of that notebook; tests/test_notebook_text.py checks that every Question
has one, and that every metric an answer names is one the kit logs.
"""

from __future__ import annotations

__all__ = ["ANSWERS", "answer_key"]

ANSWERS: dict[str, list[str]] = {
    "00_quickstart": [
        "With N = 2 a group has no spread whenever its two completions score the same, which is common; with N = 32 "
        "all 32 must tie. Compare `reward/zero_std_frac` (and the printed share of groups without spread): it should "
        "fall as N grows. `rollout/tokens_per_s` rises with N because each engine forward decodes more sequences for "
        "about the same fixed cost per step. A group whose rewards are all equal has every advantage r_i - mean = 0, "
        "so its policy term is 0 at every token: no gradient (docs/objective.md, section 1).",
        "Temperature divides the logits before sampling, so 0.7 sharpens the distribution: the N completions of a "
        "group look more alike, which pushes `reward/std` down (and `reward/zero_std_frac` up). "
        "`completion/mean_length` moves with whatever the model's most likely continuation does (stop early or run "
        "on), so read its direction from the two metrics tables rather than predicting it.",
        "The error comes from the engine config check (`cbkit.rollout.engine_config`): `return_logprobs=False` would "
        "drop the sampling logprobs, and with them the importance-sampling correction and the `logprob/*` check. "
        "cbkit refuses rather than silently running without them, which is what released TRL's CB path does.",
    ],
    "01_kv_slot_recycling": [
        "Without block sharing each of the N completions of a prompt holds its own copy of the prompt's pages and "
        "prefills the prompt itself, so fewer requests fit in the quarter pool. Compare the lines printed above the "
        "timeline (requests that took recycled blocks, the longest wait), the hatched starts of the bars, and the "
        "wall time: the prompt is now prefilled N times instead of once. With `num_blocks` set to the whole workload "
        "every request fits at once: no request waits for blocks and the block-id chart shows no hand-overs.",
        "The static batch takes as many steps as its longest row. The paged pool matches it only if every sequence "
        "that would otherwise end late starts early enough; a short sequence can start late, once an early finisher "
        "hands back its blocks. With spread 0.9 many sequences are short and finish early, so a much smaller pool "
        "keeps pace; with spread 0.2 nearly every sequence runs close to the limit and must start at once, so the "
        "pool must hold almost all of them. The explorer reserves each newcomer's worst case, so both shares are "
        "larger than the engine's optimistic admission would need.",
        "`generate()`'s KV is rows x (longest prompt + max new tokens): 4x the tokens makes every row's KV about 4x "
        "larger. Compare the printed line `planner: CB's peak drops below generate()'s from N = ...` before and after. "
        "On a GPU tier the pool is a fixed share of memory, so `generate()` outgrows it at a smaller N and the "
        "crossover moves down; on a CPU `POOL_SEQUENCES` fixes the pool in sequences at full length, so it grows 4x "
        "too and the crossover moves much less.",
    ],
    "02_logprob_correctness": [
        "With top_p = 0.95 the nucleus drops at most 5% of the mass at each token, so each TRL-style token ratio "
        "p_full / p_nucleus is at least 0.95, closer to 1 than at 0.7. Per sequence the ratios still multiply, so "
        "compare the printed per-sequence median for TRL-style against the 0.7 run: it moves towards 1 but stays "
        "below it. Doubling `MAX_NEW_TOKENS` doubles the number of factors, so the per-sequence median falls again; "
        "cbkit's stays at about 1 in every case, because it compares under the distribution that was sampled.",
        "In `token_truncate` each token gets its own ratio, clamped at `clip_max`, never zeroed. Compare the table's "
        "`is/ratio_min` and `is/ratio_max` (now token ratios, close to 1 for a bf16 rollout, not products over a "
        "completion) and `is/clipped_frac` (now a share of tokens clamped, which a token ratio rarely reaches at 3). "
        "The masked-completions line reads 0: truncation clamps, it never masks. The histogram below it still draws "
        "the per-completion products, which this mode no longer uses.",
        "fp16 keeps 10 mantissa bits against bf16's 7, so each value is rounded about 8x more finely and the rollout's "
        "logprobs sit closer to the fp32 policy's: compare the printed max and mean |diff| and the spread of the ratio "
        "histogram for the two runs. The price is range: fp16's 5-bit exponent can overflow where bf16's 8 bits do not.",
    ],
    "03_n_sweep": [
        "The printed length CV and decode padding share stay where they were, since the replayed lengths scale with "
        "the limit. The completions double against the same prompts, so (a) prompt sharing is a smaller part of the "
        "win: the prefill tokens saved are the same, the decode around them doubles. (b) padding keeps its share of a "
        "longer decode, so its seconds grow with it. Each full-length completion needs more blocks, so the same pool "
        "holds fewer of them (the pool cell prints how many) and (c) recycling has more to do. Each decode step also "
        "reads a longer context, which weighs on both backends; compare the rest and the ms per step with the first run.",
        "`max_batch_tokens` caps the tokens one engine forward takes: decode tokens plus a prefill chunk. A prompt that "
        "no longer fits is prefilled over more steps (chunked prefill), and once the running rows alone pass 512 not "
        "all of them decode in every step. Compare CB's measured peak (smaller activations and logits per forward) and "
        "its speed multiple of generate() with the first sweep's, N by N.",
        "Under `natural` EOS decides the lengths. Compare the three workloads' printed length CV and decode padding "
        "share: a model that runs most completions to the limit (SmolLM2 here, as 01 showed) puts `natural` close to "
        "`fixed`, but at the full limit rather than the replay's mean. Then check whether CB's speed multiple sits where "
        "the padding would put it; the split in *Why CB wins* says how much of the win padding carried on the replay.",
    ],
    "04_grpo_live": [
        "No metric disappears: the loop still computes and logs the `is/*` ratios (they describe the rollout), but "
        "`is/skipped` reads 1 and no weight reaches the loss. On a bf16 GPU rollout the ratios are no longer near 1 "
        "(02's section 2 measures how far), and without the correction the update is the on-policy gradient taken "
        "on off-policy samples: biased by exactly the gap the ratios show (02's section 3 prints how much the "
        "correction changes the gradient).",
        "With 16 completions per prompt a group lacks spread only if all 16 tie, so `reward/zero_std_frac` falls; each "
        "engine forward decodes more sequences for about the same fixed cost, so rollout tokens/s rises, while the "
        "step as a whole takes longer (the loss forwards grow with the number of completions). Compare the two runs' "
        "rows in the side-by-side table.",
        "A hook is any object with the `StepHooks` methods; `on_rollout_end(rollout)` receives the rollout but no "
        "rewards, so decode each completion (`policy.tokenizer.decode(c.completion_ids, skip_special_tokens=True)`) "
        "and score it yourself (for instance with `cbkit.tasks.rewards.format_reward`), or keep the rollout and print "
        "in `on_step_end`. Pass it in `hooks=[...]` next to the live chart's hook.",
        "Compare the printed rollout share of `generate()`'s step and the Amdahl ceiling at both sizes. The "
        "old-logprob forward and the update grow with the number of completions times their length; the static "
        "batch's rollout grows with the number of rows and with the longest row (more draws, a longer longest), "
        "while a decode step on a small batch costs about the same for more rows. Which grows faster on this "
        "machine decides whether the share, and the ceiling, grow or shrink.",
    ],
    "05_off_policy": [
        "In a sequence mode a completion's ratio is the product of its token ratios, so its log is the sum of the "
        "token log-ratios: it spreads with the completion's length. Compare `offpolicy/ratio_min` and "
        "`offpolicy/ratio_max` (now per completion, far wider) and `is/clipped_frac` (now the share of completions "
        "above `clip_max`, masked to weight 0) at staleness 4 with section 1's token-mode lines. One far-off token, "
        "or a small drift repeated over many tokens, takes a whole completion out of the band.",
        "At staleness 1 the rollout is one update old, so the drift (section 1's line for k=1 against k=4) is smaller, "
        "the IS ratios sit nearer 1, and the correction reweighs less. Compare the printed distance between the two "
        "runs' weights and the printed range of the IS ratios with the staleness-4 run.",
        "With two optimizer updates per step, the rollout queued on version v is trained on at version v + 2: its "
        "tokens are two updates old, past `max_staleness=1`, so the default `stale_rollouts='regenerate'` samples it "
        "again on the current weights. `offpolicy/regenerated` reads 1 at those steps, and the step time includes a "
        "whole rollout again: the overlap bought nothing.",
        "The prefix cache keeps full pages of KV keyed by token ids. A longer shared system prompt fills more full "
        "pages, so more positions of the second rollout read KV written by the old weights: compare the stale row's "
        "`vs new` gap and the printed ratio to a correct engine's gap before and after.",
    ],
}


def answer_key(stem: str) -> str:
    """The markdown of `stem`'s answer key, one numbered answer per Question, for the solutions book."""
    if stem not in ANSWERS:
        raise KeyError(f"no answer key for {stem!r}; known: {sorted(ANSWERS)}")
    items = "\n".join(f"{i}. {text}" for i, text in enumerate(ANSWERS[stem], start=1))
    return ("### Answer key (facilitators)\n"
            "What each Question's edit shows and why, and what to compare in the rerun's output.\n\n" + items)

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
        "Without block sharing every completion holds its own copy of its prompt's pages and prefills its whole "
        "prompt itself, so each needs more blocks and more query tokens. Compare section 2's step count and the "
        "first steps' `past+query` (the completions now start from past 0), section 3b's peak blocks and its waiting "
        "count, which should shift towards the blocks. The toy still shares prompt pages, so its first difference "
        "with the engine comes at the completions' first step: the rule that differs is the prefix hash.",
        "With room for every row at full length the pool never runs short of blocks, so compare section 3b's waiting "
        "count: what waiting is left comes from the read budget, which grows with the pool (page_size x num_blocks) "
        "and so binds later too. In section 4 the engine's peak rises towards the useful tokens minus the prompt "
        "sharing: with everyone running at once, recycling has little to save. The pool printed in section 4 is "
        "the price: it grows with POOL_ROWS whether or not the run uses it.",
        "A budget larger than a prompt lets the helper prefill each prompt in one step instead of in chunks of 64 "
        "tokens, and lets several completions finish their prompts in the same step, so the first steps hold more "
        "tokens and the run takes fewer steps. Compare the printed first steps (no `P` chunk cut at 64) and the "
        "step counts of section 2. Memory does not move much: the budget limits tokens per step, not KV held.",
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
        "With `clip_max=1` every completion the policy finds likelier than the sampler did gets weight 0, so the "
        "printed masked count rises to those completions (for a bf16 rollout, some of them). A weight of 0 takes a "
        "completion's term out of the update, so the IS update turns further from the unweighted one: compare the IS "
        "cosine with the first run's. The shuffled weights are the same weights, zeros included, put on other "
        "completions, so their cosines fall too: the comparison still asks whether the mismatch fell on the "
        "completions that carry the update, now with weights of a wider spread.",
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
        "Both backends still take about one forward per generated position, each now carrying 4x the tokens (on a "
        "CPU cbkit sizes the pool to the workload, so all 4N x prompts requests run at once: the most requests in one "
        "step grows 4x). Read the milliseconds a step of each: if CB's grow less than generate()'s, part of the "
        "engine's extra work was a fixed cost per step that more rows now share, and CB's tokens/s moves toward "
        "generate()'s; if both grow alike, the extra work grows with the requests in a step (per-request scheduling, "
        "block tables, cbkit's varlen attention gathering each sequence's keys). On a shared 2-core machine two CI "
        "runs disagreed (CB at 0.47x generate()'s tokens/s at both N in one, 0.38x -> 0.67x in the other): run it a "
        "few times before you decide. What moves the ratio for certain is what this shape lacks: unequal lengths "
        "(padding), a pool smaller than the rollout (recycling), prompts of several pages (sharing), and a model "
        "whose forward outweighs the engine's work.",
    ],
    "05_off_policy": [
        "In a sequence mode a completion's ratio is the product of its token ratios, so its log is the sum of the "
        "token log-ratios: it spreads with the completion's length. Compare section 1's printed std of the IS ratios "
        "(`offpolicy/ratio_std`, now per completion, far wider) and section 2's `clipped` column (`is/clipped_frac`, "
        "now the share of completions above `clip_max`, masked to weight 0) at staleness 4 with the token-mode run. "
        "One far-off token, or a small drift repeated over many tokens, takes a whole completion out of the band.",
        "At staleness 1 the rollout is one update old, so the drift (section 1's line for k=1 against k=4) is smaller, "
        "the IS ratios sit nearer 1, and the correction reweighs each token less; but the rollouts come from weights "
        "the two runs' updates made from step 3 on, not step 6, so the table has more steps whose tokens differ. "
        "Compare the printed distance between the two runs' weights, the table's `clipped` column and the step from "
        "which the rollouts differ with the staleness-4 run: the smaller reweighting and the longer feedback pull the "
        "distance in opposite directions, and the run says which wins.",
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

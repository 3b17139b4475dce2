"""Exercises a learner implements in the notebooks, and the checks that grade them.

Each notebook ends with a few functions to write, each a piece of the mechanism it teaches, given as a signature,
a docstring and a stub that raises `NotImplementedError`. The cell after it calls `check_<name>(fn)`, which runs
the function on a table of cases drawn from a seed (the edge cases first), compares every answer with the kit's
own tested code, and prints one verdict: pass, not implemented yet, or the first failing case with its inputs,
the expected value, the learner's, and a hint. It returns the verdict as a `Result` and never raises for a wrong
answer. `cbkit.teach.exercises.solutions` holds the facilitator's answers; the solutions book shows them.
"""

from collections.abc import Callable

from cbkit.teach.exercises.checks import (
    check_aggregate_loss,
    check_format_score,
    check_fresh_groups,
    check_group_advantages,
    check_padding_share,
    check_schedule_step,
    check_sequence_mask_weights,
    check_static_kv_bytes,
    check_token_is_weights,
)
from cbkit.teach.exercises.grading import Result

# notebook -> its exercises, in the order the notebook asks them: (solution name, check). The solutions book and
# the tests read this table; docs/workshop.md lists the same exercises with their times.
EXERCISES: dict[str, list[tuple[str, Callable[..., Result]]]] = {
    "00_quickstart": [("format_score", check_format_score)],
    "01_kv_slot_recycling": [("padding_share", check_padding_share), ("schedule_step", check_schedule_step)],
    "02_logprob_correctness": [("token_is_weights", check_token_is_weights),
                               ("sequence_mask_weights", check_sequence_mask_weights)],
    "03_n_sweep": [("static_kv_bytes", check_static_kv_bytes)],
    "04_grpo_live": [("group_advantages", check_group_advantages), ("aggregate_loss", check_aggregate_loss)],
    "05_off_policy": [("fresh_groups", check_fresh_groups)],
}

__all__ = ["EXERCISES", "Result", "check_aggregate_loss", "check_format_score", "check_fresh_groups",
           "check_group_advantages", "check_padding_share", "check_schedule_step", "check_sequence_mask_weights",
           "check_static_kv_bytes", "check_token_is_weights"]

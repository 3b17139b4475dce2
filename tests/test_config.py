"""CBGRPOConfig: TRL's names, cbkit's defaults, and errors that say what to change."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from cbkit.tasks.rewards import resolve_rewards
from cbkit.train.config import CBGRPOConfig
from cbkit.train.objective import IS_MODES


def test_defaults_use_trl_names_and_cb_defaults():
    c = CBGRPOConfig()
    assert (c.num_generations, c.loss_type, c.scale_rewards, c.beta, c.epsilon) == (8, "dapo", "group", 0.0, 0.2)
    assert c.importance_sampling_mode == "sequence_mask" and c.clip_max == 3.0
    assert c.transformers_continuous_batching_config == {}  # the user's keys only; the engine adds the defaults
    assert c.backend == "continuous" and c.cb_overrides() == {}
    assert resolve_rewards(c.reward_funcs, c.reward_weights)[1] == [1.0, 0.5]
    assert all(f.metadata.get("help") for f in dataclasses.fields(CBGRPOConfig)), "every field needs help text"


def test_cb_config_keeps_the_users_keys_and_the_engine_merges_the_defaults_under_them():
    from cbkit.rollout.engine_config import make_cb_config

    c = CBGRPOConfig(transformers_continuous_batching_config={"max_memory_percent": 0.3, "max_batch_tokens": 64})
    assert c.transformers_continuous_batching_config == c.cb_overrides() == {
        "max_memory_percent": 0.3, "max_batch_tokens": 64}
    resolved = make_cb_config(c.cb_overrides())
    assert (resolved.max_memory_percent, resolved.max_batch_tokens, resolved.use_cuda_graph) == (0.3, 64, False)
    # A key set to its default value is still the user's choice: it is kept, not stripped.
    assert CBGRPOConfig(transformers_continuous_batching_config={"max_memory_percent": 0.5}).cb_overrides() == {
        "max_memory_percent": 0.5}


def test_a_saved_config_with_the_defaults_spelled_out_resumes_under_one_without():
    saved = CBGRPOConfig(transformers_continuous_batching_config={"max_memory_percent": 0.5, "use_cuda_graph": False})
    assert saved.diff(CBGRPOConfig()) == {}
    assert saved.diff(CBGRPOConfig(transformers_continuous_batching_config={"max_memory_percent": 0.3})) == {
        "transformers_continuous_batching_config": ({"max_memory_percent": 0.5, "use_cuda_graph": False},
                                                    {"max_memory_percent": 0.3})}


def test_use_transformers_paged_forwards_with_future_warning():
    with pytest.warns(FutureWarning, match="use_transformers_continuous_batching"):
        c = CBGRPOConfig(use_transformers_paged=False)
    assert c.use_transformers_continuous_batching is False and c.backend == "generate"
    assert c.use_transformers_paged is None  # normalised: a round trip does not warn again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CBGRPOConfig.from_dict(c.to_dict())


def test_round_trip():
    c = CBGRPOConfig(model="tiny", top_p=0.9, reward_funcs=["format"], reward_weights=[2.0], epsilon_high=0.28)
    again = CBGRPOConfig.from_dict(c.to_dict())
    assert again == c and again.diff(c) == {}
    assert CBGRPOConfig.from_dict(__import__("json").loads(__import__("json").dumps(c.to_dict()))) == c


def test_diff_ignores_fields_a_resume_may_change():
    a = CBGRPOConfig(max_steps=5, output_dir="x")
    b = CBGRPOConfig(max_steps=9, output_dir="y", learning_rate=1e-3)
    assert a.diff(b) == {"learning_rate": (1e-5, 1e-3)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_generations=1), "num_generations=1.*at least 2"),
        (dict(epsilon=0.0), "epsilon=0.0 must be > 0"),
        (dict(epsilon_high=-0.1), "epsilon_high"),
        (dict(clip_min=4.0), "clip_min=4.0 must be in .0, clip_max=3.0"),
        (dict(clip_max=0.0), "clip_max=0.0 must be > 0"),
        (dict(loss_type="ppo"), "loss_type='ppo'.*'grpo', 'dr_grpo', 'dapo', 'bnpo'"),
        (dict(scale_rewards="True"), "scale_rewards='True'.*'group', 'batch', 'none'"),
        (dict(advantage_estimator="reinforce"), "advantage_estimator='reinforce'.*'grpo', 'rloo'"),
        (dict(importance_sampling_mode="token"), "importance_sampling_mode='token'.*" + IS_MODES[0]),
        (dict(advantage_estimator="rloo"), "rloo.*scale_rewards='none'"),
        (dict(prompts_per_step=3, num_generations=2, gradient_accumulation_steps=4),
         r"6 completions do not split into gradient_accumulation_steps=4.*\[1, 2, 3, 6\]"),
        (dict(temperature=0.0), "temperature=0.0 must be > 0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(beta=-1.0), "beta=-1.0"),
        (dict(learning_rate=0.0), "learning_rate=0.0"),
        (dict(max_steps=0), "max_steps=0 must be >= 1"),
        (dict(num_iterations=0), "num_iterations=0"),
        (dict(reward_weights=[1.0]), "reward_weights has 1 entries for 2 reward_funcs"),
        (dict(reward_funcs=[]), "reward_funcs is empty"),
        (dict(transformers_continuous_batching_config={"max_memory_percent": 1.5}), r"max_memory_percent.*\(0, 1\]"),
        (dict(transformers_continuous_batching_config={"max_memory_percent": 0.0}), r"max_memory_percent.*\(0, 1\]"),
        (dict(transformers_continuous_batching_config={"blocksize": 4}), "Unknown continuous batching config key"),
        (dict(transformers_continuous_batching_config={"return_logprobs": False}), "return_logprobs=False"),
    ],
)
def test_bad_values_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CBGRPOConfig(**kwargs)


def test_unknown_field_suggests_the_close_one():
    with pytest.raises(ValueError, match="'num_generation' \\(did you mean 'num_generations'\\?\\)"):
        CBGRPOConfig.from_dict({"num_generation": 4})


def test_rloo_with_batch_scaling_is_accepted():
    """RLOO has no per-group scaling (as TRL's RLOO), but scales over the batch or not at all."""
    for scale in ("batch", "none"):
        assert CBGRPOConfig(advantage_estimator="rloo", scale_rewards=scale).scale_rewards == scale


def test_trl_names_for_the_bridge():
    c = CBGRPOConfig(prompts_per_step=3, num_generations=4, gradient_accumulation_steps=2)
    assert c.per_device_train_batch_size == 6  # TRL's micro-batch in completions: 3 x 4 / 2
    assert c.kl_bias_correction is True  # TRL's use_bias_correction_kl default


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own
def test_trl_bridge_maps_this_config():
    from cbkit.trl.config import trl_grpo_config

    c = CBGRPOConfig(clip_max=2.0, clip_min=0.5, importance_sampling_mode="token_truncate", prompts_per_step=2,
                     num_generations=4, gradient_accumulation_steps=2, learning_rate=3e-5)
    t = trl_grpo_config(c, output_dir="unused")
    assert (t.vllm_importance_sampling_clip_max, t.vllm_importance_sampling_clip_min) == (2.0, 0.5)
    assert t.vllm_importance_sampling_mode == "token_truncate" and t.learning_rate == 3e-5
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps, t.num_generations) == (4, 2, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # The recipe's `learning_rate: abc`: before this check, `learning_rate > 0` raised a TypeError.
        (dict(learning_rate="abc"), r"learning_rate='abc' \(str\) is not a number; e.g. `learning_rate: 1e-05`"),
        (dict(num_generations="four"), r"num_generations='four' \(str\) is not an integer; e.g. `num_generations: 8`"),
        (dict(max_steps=2.5), r"max_steps=2.5 \(float\) is not an integer"),
        (dict(disable_tqdm=1), r"disable_tqdm=1 \(int\) is not true or false; e.g. `disable_tqdm: false`"),
        (dict(learning_rate=True), r"learning_rate=True \(bool\) is not a number"),
        (dict(scale_rewards=True), r"scale_rewards=True \(bool\) is not a string; e.g. `scale_rewards: group`"),
        (dict(epsilon_high="x"), r"epsilon_high='x' \(str\) is not a number or null"),
        (dict(reward_weights=[1.0, "a"]), r"reward_weights=\[1.0, 'a'\] \(list\) is not a list of numbers"),
        (dict(reward_funcs="correctness"), r"reward_funcs='correctness' \(str\) is not a list of strings; "
                                           r'e.g. `reward_funcs: \["correctness", "format"\]`'),
        (dict(data_options=[1]), r"data_options=\[1\] \(list\) is not a mapping"),
        # An Optional field whose default is None gets an example of its type, not `null`.
        (dict(num_problems="all"), r"num_problems='all' \(str\) is not an integer or null.*`num_problems: 1`"),
        # The system prompt's default is too long to quote as an example.
        (dict(system_prompt=3), r"system_prompt=3 \(int\) is not a string or null.*`system_prompt: text`"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field_and_an_example(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CBGRPOConfig(**kwargs)


def test_every_field_is_checked_against_its_type():
    """Generic over the dataclass: a field added later is checked too, and named, whatever its type."""
    for f in dataclasses.fields(CBGRPOConfig):
        with pytest.raises(ValueError, match=rf"^{f.name}=<object object .*> \(object\) is not "):
            CBGRPOConfig(**{f.name: object()})


def test_numbers_take_the_fields_type_where_nothing_is_lost():
    import numpy as np
    import yaml

    # PyYAML follows YAML 1.1: `1e-6` (no dot) is a string, `3` an int; both mean the float a float field holds.
    values = yaml.safe_load("learning_rate: 1e-6\nepsilon: 3\nreward_weights: [1, 0.5]\nmax_steps: 8.0\n")
    assert values["learning_rate"] == "1e-6" and type(values["epsilon"]) is int
    c = CBGRPOConfig.from_dict({**values, "top_p": np.float32(0.5), "seed": np.int64(3), "num_problems": "16"})
    assert (c.learning_rate, c.epsilon, c.reward_weights, c.max_steps) == (1e-6, 3.0, [1.0, 0.5], 8)
    assert [type(v) for v in (c.learning_rate, c.epsilon, *c.reward_weights, c.max_steps, c.top_p, c.seed,
                              c.num_problems)] == [float, float, float, float, int, float, int, int]
    # Values already of their type are left as they are (the same objects).
    weights, cb = [1.0, 0.5], {"max_batch_tokens": 64}
    c = CBGRPOConfig(reward_weights=weights, transformers_continuous_batching_config=cb)
    assert c.reward_weights is weights and c.transformers_continuous_batching_config is cb

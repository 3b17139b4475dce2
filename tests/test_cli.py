"""cbkit.cli on its own: bad input is one line on stderr and exit status 2, before any model is loaded."""

from __future__ import annotations

import pytest

from cbkit.cli import build_parser, main
from cbkit.cli.train import train_config_from_args


def train_config(argv):
    """The `CBGRPOConfig` that `cbkit train <argv>` would run, without running it."""
    return train_config_from_args(build_parser().parse_args(["train", *argv]))


@pytest.fixture
def no_model_loads(monkeypatch):
    """Bad input must be refused before the expensive part: loading a model fails the test."""
    import cbkit.models.load

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(cbkit.models.load, "load_policy", refuse)


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--model", "tiny"], "cbkit train needs --output-dir"),
    (["train", "--output-dir", "{tmp}", "--num-generations", "1"], "num_generations=1"),
    (["train", "--output-dir", "{tmp}", "--loss-type", "ppo"], "loss_type='ppo'"),
    (["train", "--output-dir", "{tmp}", "--resume"], "no checkpoint-<step> directory"),
    (["report", "{tmp}/missing.jsonl"], "No results file"),
    (["sweep", "--ns", "8,,x", "--no-live", "--model", "tiny"], "--ns takes comma-separated integers"),
])
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys, no_model_loads):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    # argparse's own errors print the usage first; the last line says what is wrong either way.
    assert err.strip().splitlines()[-1].startswith(f"cbkit {argv[0]}: error:") and message in err
    assert "Traceback" not in err


def test_a_mistyped_flag_value_is_refused_by_the_parser(capsys):
    assert main(["train", "--output-dir", "x", "--num-generations", "four"]) == 2
    assert "argument --num_generations/--num-generations: invalid int value: 'four'" in capsys.readouterr().err


def test_every_config_field_is_a_train_flag(capsys):
    import dataclasses

    from cbkit.train.config import CBGRPOConfig

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    missing = [f.name for f in dataclasses.fields(CBGRPOConfig) if "--" + f.name.replace("_", "-") not in out]
    assert missing == []


# --- one run, three ways to write it ---------------------------------------------------------------------------

RECIPE = """\
model: tiny
num_generations: 4
reward_funcs: [correctness, format]
reward_weights: [1.0, 0.25]
epsilon_high: null
system_prompt: null
use_transformers_continuous_batching: false
transformers_continuous_batching_config: {max_batch_tokens: 64}
output_dir: runs/x
"""
FLAGS = ["--model", "tiny", "--num-generations", "4", "--reward-funcs", "correctness", "format",
         "--reward_weights", "1,0.25", "--epsilon-high", "none", "--system-prompt", "none",
         "--no-use-transformers-continuous-batching", "--transformers-continuous-batching-config",
         '{"max_batch_tokens": 64}', "--output-dir", "runs/x"]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own
def test_a_recipe_flags_and_python_give_the_same_config(tmp_path):
    import dataclasses

    from cbkit.train.config import CBGRPOConfig

    python = CBGRPOConfig(model="tiny", num_generations=4, reward_weights=[1.0, 0.25], epsilon_high=None,
                          system_prompt=None, use_transformers_continuous_batching=False,
                          transformers_continuous_batching_config={"max_batch_tokens": 64}, output_dir="runs/x")
    recipe = tmp_path / "run.yaml"
    recipe.write_text(RECIPE)
    assert train_config(["--config", str(recipe)]) == train_config(FLAGS) == python
    # Flags given next to the recipe win; the rest of the recipe stays.
    mixed = train_config(["--config", str(recipe), "--num-generations", "8", "--reward-weights", "none"])
    assert mixed == dataclasses.replace(python, num_generations=8, reward_weights=None)

    # The recipe is TRL's --config format: TRL's own parser reads the same file into the same config...
    trl = pytest.importorskip("trl")
    (parsed,) = trl.TrlParser(CBGRPOConfig).parse_args_and_config(["--config", str(recipe)])
    assert parsed == python
    # ...and the TRL bridge maps it as it maps the Python config.
    from cbkit.trl.config import trl_grpo_config

    assert (trl_grpo_config(train_config(["--config", str(recipe)]), str(tmp_path)).to_dict()
            == trl_grpo_config(python, str(tmp_path)).to_dict())


def test_a_bad_recipe_says_what_to_change(tmp_path, capsys):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("num_generation: 4\noutput_dir: x\n")
    assert main(["train", "--config", str(recipe)]) == 2
    assert "'num_generation' (did you mean 'num_generations'?)" in capsys.readouterr().err
    recipe.write_text("learning_rate: 5e-5\noutput_dir: x\n")  # YAML 1.1 reads 5e-5 as a string

    assert train_config(["--config", str(recipe)]).learning_rate == 5e-5
    recipe.write_text("- model: tiny\n")
    assert main(["train", "--config", str(recipe)]) == 2
    assert "must hold a YAML mapping of config fields" in capsys.readouterr().err


def test_sweep_flags_are_the_sweep_config_fields():
    """Every SweepConfig field is a flag (a field added later too), with its field's help."""
    import dataclasses

    from cbkit.cli import build_parser
    from cbkit.cli.flags import given_fields
    from cbkit.measure.sweep_config import SweepConfig

    args = build_parser().parse_args(["sweep", "--ns", "8,16", "32", "--num-prompts", "3", "--lengths", "fixed",
                                      "--cb-config", '{"num_blocks": 64}', "--backends", "generate,continuous"])
    given = given_fields(args, SweepConfig)
    assert given == {"ns": [8, 16, 32], "num_prompts": 3, "lengths": "fixed",
                     "cb_config": {"num_blocks": 64}, "backends": ["generate", "continuous"]}
    assert SweepConfig(**given).ns == (8, 16, 32)
    flags = {s for a in build_parser()._subparsers._group_actions[0].choices["sweep"]._actions
             for s in a.option_strings}
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(SweepConfig)} <= flags
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["sweep"]._actions}
    for f in dataclasses.fields(SweepConfig):
        assert helps[f.name].startswith(f.metadata["help"].replace("%", "%%")), f.name
    # The A/B knobs of the CPU tuning live in lab/ scripts, not in the product's flags.
    assert not {"--cpu-attention", "--engine-loop"} & flags


def test_the_shipped_recipe_is_the_readme_run():
    from pathlib import Path


    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_cpu.yaml"
    flags = ["--model", "smollm2-offline", "--data", "synthetic", "--prompts-per-step", "2", "--num-generations", "8",
             "--max-completion-length", "64", "--temperature", "0.7", "--learning-rate", "5e-5", "--max-steps", "16",
             "--gradient-accumulation-steps", "2", "--output-dir", "runs/learn", "--save-steps", "1"]
    assert train_config(["--config", str(recipe)]) == train_config(flags)


@pytest.mark.parametrize("command", ["sweep", "train"])
@pytest.mark.parametrize(("value", "says"), [("{bad json", "is not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_a_bad_json_flag_is_named_in_one_line(capsys, command, value, says, no_model_loads):
    flag = "--transformers-continuous-batching-config" if command == "train" else "--cb-config"
    assert main([command, "--model", "tiny", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cbkit {command}: error: {flag} {says}") and len(err.strip().splitlines()) == 1


def test_plan_flags_are_its_dataclass_with_the_old_spellings():
    """`plan` parses into `PlanConfig`; the spellings the README and earlier releases use (-N, --prompts) still
    reach the right field, and a flag the training run also has carries CBGRPOConfig's help, not a copy."""
    import dataclasses

    from cbkit.cli.flags import given_fields
    from cbkit.cli.plan import PlanConfig
    from cbkit.train.config import CBGRPOConfig

    args = build_parser().parse_args(["plan", "-N", "64", "--prompts", "2", "--prompt-len", "50", "--budget-gb", "1"])
    a = PlanConfig(**given_fields(args, PlanConfig))
    assert (a.num_generations, a.num_prompts, a.prompt_len, a.budget_gb, a.device) == (64, 2, 50, 1.0, "cuda")
    grpo_help = {f.name: f.metadata["help"] for f in dataclasses.fields(CBGRPOConfig)}
    plan_help = {f.name: f.metadata["help"] for f in dataclasses.fields(PlanConfig)}
    assert plan_help["max_new_tokens"] == grpo_help["max_completion_length"]


def test_plan_without_n_is_a_usage_error(capsys):
    assert main(["plan", "--model", "tiny"]) == 2
    assert "required: --num_generations/--num-generations/-N" in capsys.readouterr().err

"""cbkit.cli on its own: bad input is one line on stderr and exit status 2, before any model is loaded."""

from __future__ import annotations

import pytest

from cbkit.cli import main


@pytest.fixture
def no_model_loads(monkeypatch):
    """Bad input must be refused before the expensive part: loading a model fails the test."""
    import cbkit.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(cbkit.models, "load_policy", refuse)


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
    assert err.startswith(f"cbkit {argv[0]}: error:") and message in err
    assert "Traceback" not in err


def test_a_mistyped_flag_value_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--output-dir", "x", "--num-generations", "four"])
    assert exit_info.value.code == 2
    assert "--num-generations" in capsys.readouterr().err


def test_every_config_field_is_a_train_flag(capsys):
    import dataclasses

    from cbkit.config import CBGRPOConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    missing = [f.name for f in dataclasses.fields(CBGRPOConfig) if "--" + f.name.replace("_", "-") not in out]
    assert missing == []

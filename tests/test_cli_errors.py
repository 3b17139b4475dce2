"""Errors at the edges of the CLI: one line that says what to change, no traceback, before any expensive work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cbkit.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_an_unknown_hub_model_offline_says_what_to_use_instead(tmp_path):
    # A subprocess: huggingface_hub reads HF_HUB_OFFLINE when it is imported.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "cbkit.cli", "sweep", "--model", "does-not/exist",
                           "--out", str(tmp_path / "sweep.jsonl")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    err = done.stderr.strip().splitlines()
    assert err[0].startswith("cbkit sweep: error: Could not load 'does-not/exist' as a Hugging Face hub id")
    assert "local model directory" in done.stderr and "'smollm2-offline'" in done.stderr


@pytest.mark.parametrize(("value", "says"), [("{bad json", "is not valid JSON"), ("[1, 2]", "must be a JSON object")])
def test_a_bad_cb_config_names_the_flag(capsys, value, says):
    assert main(["sweep", "--model", "tiny", "--cb-config", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cbkit sweep: error: --cb-config {says}")


def test_a_recipe_value_of_the_wrong_type_names_the_field_and_an_example(tmp_path, capsys):
    """`learning_rate: abc` in a recipe once ended in "TypeError: '>' not supported between instances of 'str' and
    'int'", a traceback naming no field; the flag's twin is argparse's own error, naming the flag."""
    recipe = tmp_path / "run.yaml"
    recipe.write_text("model: tiny\nlearning_rate: abc\n")
    assert main(["train", "--config", str(recipe), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cbkit train: error: learning_rate='abc' (str) is not a number; "
                          "e.g. `learning_rate: 1e-05` in a recipe"), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert main(["train", "--learning_rate", "abc", "--output-dir", str(tmp_path / "out")]) == 2
    assert "--learning_rate" in (err := capsys.readouterr().err) and "'abc'" in err, err

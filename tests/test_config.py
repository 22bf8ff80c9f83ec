"""Defaults a reader can see: Args holds the study's, BUILTIN (beside it in each script) the built-in task's preset,
applied under the command line when no --model is given; the start-up line names every value that differs."""
import importlib

import pytest

from common.cli import config_changes
from conftest import SCRIPTS

# every algorithm script (conftest.SCRIPTS) and the sanity tools, which have a BUILTIN preset too
MODULES = [s.removesuffix(".py") for s in SCRIPTS] + ["sanity.build_perfectible", "sanity.mismatch_analysis",
                                                     "sanity.run_sanity"]


@pytest.mark.parametrize("name", MODULES)
def test_preset_without_model_and_study_defaults_with_one(name):
    m = importlib.import_module(name)
    field, value = next(iter(m.BUILTIN.items()))
    assert getattr(m.parse_args([]), field) == value != getattr(m.Args(), field)
    assert getattr(m.parse_args(["--model", "some/dir"]), field) == getattr(m.Args(), field)  # the study's


def test_command_line_goes_over_the_preset():
    import grpo
    assert grpo.BUILTIN["lr"] == 5e-4 and grpo.Args().lr == 1e-6  # what `python grpo.py` uses, and where
    args = grpo.parse_args(["--lr", "1e-3", "--num-steps", "100"])
    assert args.lr == 1e-3 and args.max_response_len == grpo.BUILTIN["max_response_len"]
    line = config_changes(args, grpo.Args(), grpo.BUILTIN, "BUILTIN in grpo.py")
    preset, cli = line.split("; command line: ")
    assert "BUILTIN in grpo.py: " in preset and "max_response_len 8" in preset and "num_steps 100" in preset
    assert cli == "lr 0.001"  # not the preset's 5e-4


def test_study_run_names_only_the_command_line():
    import grpo
    args = grpo.parse_args(["--model", "some/dir", "--reward", "number", "--is-correction", "token-tis"])
    assert config_changes(args, grpo.Args(), {}, "BUILTIN") == ("[config] Args' defaults, except: command line: "
                                                                "model some/dir, reward number, is_correction token-tis")
    assert config_changes(grpo.Args(), grpo.Args(), {}, "BUILTIN") == "[config] Args' defaults"

"""The logger: metrics.jsonl and config.json on rank 0, nothing elsewhere, wandb only with --track (offline here)."""
import json
import os

from common.logger import Logger, fmt


def test_metrics_jsonl_and_config(tmp_path, capsys):
    log = Logger(str(tmp_path), {"lr": 1e-6}, enabled=True, total_steps=2)
    log.log({"train/accuracy": 0.5, "mismatch/kl_k3": 1.5e-5}, step=1)
    log.log({"eval/x/accuracy": 0.25}, step=1, advance=False)
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 1, "train/accuracy": 0.5, "mismatch/kl_k3": 1.5e-5}, {"step": 1, "eval/x/accuracy": 0.25}]
    assert json.load(open(tmp_path / "config.json")) == {"lr": 1e-6}
    out = capsys.readouterr()
    assert "step 1 | acc 0.5 | kl_k3 1.50e-05" in out.out + out.err


def test_other_ranks_write_nothing(tmp_path):
    log = Logger(str(tmp_path / "r1"), {}, enabled=False, total_steps=2)
    log.log({"a": 1.0}, step=1)
    log.close()
    assert not os.path.exists(tmp_path / "r1")


def test_track_uses_wandb_offline_without_an_account(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no account
    log = Logger(str(tmp_path / "run"), {"lr": 1.0}, enabled=True, total_steps=1, track=True, run_name="t")
    assert log.wandb.settings.mode == "offline"
    log.log({"train/accuracy": 1.0}, step=1)
    log.close()
    assert os.path.isdir(tmp_path / "run" / "wandb")


def test_fmt():
    assert fmt(1.5e-5) == "1.50e-05" and fmt(0.25) == "0.25" and fmt(3) == "3" and fmt(0.0) == "0"

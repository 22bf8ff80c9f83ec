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


def test_a_resume_records_its_settings_beside_config_json(tmp_path):
    """config.json keeps the settings the run started with; each resume writes its own record, never over another."""
    Logger(str(tmp_path), {"lr": 1.0}, enabled=True, total_steps=2).close()
    Logger(str(tmp_path), {"lr": 0.5}, enabled=True, total_steps=4, start_step=2).close()
    Logger(str(tmp_path), {"lr": 0.25}, enabled=True, total_steps=4, start_step=2).close()  # again from step 2
    assert json.load(open(tmp_path / "config.json")) == {"lr": 1.0}
    assert json.load(open(tmp_path / "config_resume_000002.json")) == {"lr": 0.5}
    assert json.load(open(tmp_path / "config_resume_000002_2.json")) == {"lr": 0.25}


def test_a_full_disk_stops_the_run_with_one_line(tmp_path):
    """Before: OSError [Errno 28] and a traceback. /dev/full: every write fails with ENOSPC, as on a full disk."""
    import pytest
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    log = Logger(str(tmp_path), {}, enabled=True, total_steps=2)
    mode = log.file.mode  # the logger's own way of writing, onto a full disk
    log.file.close()
    log.file = open("/dev/full", mode, **({"buffering": 0} if "b" in mode else {}))
    with pytest.raises(Exception) as e:
        log.log({"train/accuracy": 0.5}, step=7)
    assert str(e.value) == (f"step 7: cannot write {tmp_path}/metrics.jsonl: no space left on {tmp_path} (No space "
                            "left on device)")
    assert type(e.value).__name__ == "LogWriteError"  # a TrainingFault: exit code 3


def test_a_row_that_lost_only_its_newline_gets_it_back_on_resume(tmp_path):
    """A crash (or a full disk) between a row and its newline: before, the resumed run's first row was appended to
    that line, and neither could be read back."""
    from common.logger import open_metrics
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}')
    with open_metrics(str(path), start_step=2) as f:
        f.write(b'{"step": 3, "x": 3}\n')
    assert [json.loads(line)["step"] for line in open(path)] == [1, 2, 3]

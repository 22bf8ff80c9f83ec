"""Progress on long work: the step line's elapsed time and estimate of the time left (common/logger.py), and the
byte count of a checkpoint's weights file as it is written (common/checkpoint.py write_safetensors)."""
import types

import pytest
import torch
from safetensors.torch import load_file

import common.logger
from common.checkpoint import write_safetensors
from common.logger import Logger, eta_s, fmt_duration


def test_eta_is_the_mean_step_time_without_the_first_step_times_the_steps_left():
    assert eta_s([], 10) is None and eta_s([40.0], 10) is None  # step 1 alone (compilation): no estimate yet
    assert eta_s([40.0, 2.0, 4.0], 5) == 15.0  # mean(2, 4) = 3 s a step, 5 steps left; the 40 s step 1 left out
    assert eta_s([40.0, 2.0, 4.0], 0) == 0.0
    assert fmt_duration(0.9) == "0s" and fmt_duration(59.99) == "59s" and fmt_duration(65) == "1m05s"
    assert fmt_duration(3600 * 2 + 60 * 7 + 59) == "2h07m"


def test_step_line_shows_elapsed_and_time_left(tmp_path, capsys, monkeypatch):
    """A clock that says: the logger starts at 0, step 1 (which compiles) ends at 50 s, step 2 at 52, step 3 at 56."""
    ticks = iter([0.0, 50.0, 52.0, 56.0])
    monkeypatch.setattr(common.logger, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    log = Logger(str(tmp_path), {}, enabled=True, total_steps=10)
    for step in (1, 2, 3):
        log.log({"train/accuracy": 0.5}, step=step)
    log.close()
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.startswith("step ")]
    assert lines[0].endswith("| elapsed 50s") and "left" not in lines[0]
    assert lines[1].endswith("| elapsed 52s | left ~16s")  # 8 steps left x 2 s
    assert lines[2].endswith("| elapsed 56s | left ~21s")  # 7 steps left x mean(2, 4) s


def _weights():
    return [("a.weight", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b.bias", torch.ones(5, dtype=torch.float16))]


def test_write_safetensors_reports_bytes_written(tmp_path):
    path = str(tmp_path / "model.safetensors")
    entries = [(n, tuple(t.shape), t.dtype) for n, t in _weights()]
    calls = []
    write_safetensors(path, entries, iter(_weights()), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(24, 34), (34, 34)]  # 6 fp32 = 24 bytes, then 5 fp16 = 10 more
    loaded = load_file(path)
    for name, t in _weights():
        assert torch.equal(loaded[name], t)


@pytest.mark.parametrize("min_bytes,shown", [(0, True), (35, False)])
def test_write_safetensors_shows_a_bar_only_for_large_files(tmp_path, capsys, min_bytes, shown):
    entries = [(n, tuple(t.shape), t.dtype) for n, t in _weights()]
    write_safetensors(str(tmp_path / "m.safetensors"), entries, iter(_weights()), progress_min_bytes=min_bytes)
    assert ("[checkpoint] m.safetensors" in capsys.readouterr().err) == shown  # 34 bytes: a bar from 0, none from 35

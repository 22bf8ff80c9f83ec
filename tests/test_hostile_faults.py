"""Faults a hostile battery found, as a user meets them (docs/faults.md): Ctrl-C during a save is an interrupt (exit
130, the previous checkpoint intact, on every rank), a second Ctrl-C while the first is handled changes nothing of
that, a full disk when the log or a checkpoint is written is said as such in one line (exit 3) and the next resume
repairs the log, a plug-in reward whose module hangs at import stops the start with one line (exit 2). The scripts
run in subprocesses with the fault injected at a known point (tests/fault_injection.py): no test depends on timing."""
import errno
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from test_bad_input import assert_one_line_error
from test_faults import two_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
SMALL = ["--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0",
         "--save-every", "1", "--keep-last", "0"]


def inject(script, mode, from_step, run_dir, *args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fault_injection.py"), script, mode,
                           str(from_step), "--run-dir", str(run_dir), *SMALL, *args], cwd=cwd, env=env or ENV,
                          capture_output=True, text=True, timeout=600)


def checkpoints(run_dir):
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C during a save


@pytest.mark.parametrize("mode,newest", [("save-dcp-raise", 1), ("save-sigint-weights", 1), ("save-sigint-rename", 2)])
def test_ctrl_c_during_a_save_is_an_interrupt(tmp_path, mode, newest):
    """Ctrl-C in a phase of step 2's save: exit 130 with the mid-run Ctrl-C's line, step 1's checkpoint intact and the
    newest complete one (after the rename: step 2's, complete). Before, a Ctrl-C that DCP's writer caught (it catches
    BaseException) ended in exit 3, `checkpoint ... not saved: rank 0: KeyboardInterrupt` (save-dcp-raise)."""
    p = inject("grpo.py", mode, 2, tmp_path, "--num-steps", "3")
    assert p.returncode == 130, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("grpo.py:")]
    assert lines == [f"grpo.py: interrupted at step 2; resume with --resume latest (step {newest})"], p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    expected = ["step_000001", "step_000002"] if newest == 2 else ["step_000001", "step_000002.tmp"]
    assert checkpoints(tmp_path) == expected
    from common.checkpoint import find_resume_dir
    assert find_resume_dir("latest", os.path.join(tmp_path, "checkpoints")).endswith(f"step_{newest:06d}")


def test_ctrl_c_on_one_rank_during_a_save_stops_every_rank(tmp_path):
    """2 ranks (gloo); rank 0 alone gets the SIGINT, as it starts writing model.safetensors. It goes on taking part
    in the gathers of the weights, then every rank learns of the interrupt where the ranks agree after the phase:
    both exit 130 with the same line (no rank is left waiting in a collective), step 1 stays the newest."""
    procs, outs = two_ranks("tests/fault_injection.py", "grpo.py", "save-sigint-weights", "2", "--run-dir",
                            str(tmp_path), *SMALL, "--num-steps", "3")
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 130, err[-3000:]
        assert [line for line in err.splitlines() if line.startswith("grpo.py:")] == [
            "grpo.py: interrupted at step 2; resume with --resume latest (step 1)"], err[-3000:]
    assert checkpoints(tmp_path) == ["step_000001", "step_000002.tmp"]


@pytest.mark.parametrize("mode", ["save-sigint-weights-at-exit", "save-sigint-weights-twice"])
def test_a_ctrl_c_held_by_a_save_counts_as_the_first(tmp_path, mode):
    """The first Ctrl-C lands in step 2's save (held), the second during the clean-up at exit (a library's atexit
    callback) or in the same save. Before, the held one was not counted, so the second was taken as a first: raised
    in the clean-up at exit, it printed `Exception ignored in atexit callback` and a KeyboardInterrupt traceback.
    Now the second ends the process at once: exit 130, the one line, nothing after it."""
    p = inject("grpo.py", mode, 2, tmp_path, "--num-steps", "3")
    assert p.returncode == 130, p.stderr[-3000:]
    err = p.stderr.splitlines()
    said = [i for i, line in enumerate(err) if line.startswith("grpo.py:")]
    assert [err[i] for i in said] == ["grpo.py: interrupted at step 2; resume with --resume latest (step 1)"], \
        p.stderr[-3000:]
    assert not [line for line in err[said[0] + 1:] if line.strip()], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr
    assert checkpoints(tmp_path) == ["step_000001", "step_000002.tmp"]


def test_a_sigint_inside_a_deferred_section_waits_and_a_second_one_acts():
    code = textwrap.dedent("""
        import os, signal
        from common.exits import SigintDeferred
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever this process inherited
        with SigintDeferred() as d:
            signal.raise_signal(signal.SIGINT)  # held (raise_signal: to this thread, handled before it returns; a
            assert d.pending  # kill() of our pid may go to another thread, as torch's, and be handled later)
            try:
                signal.raise_signal(signal.SIGINT)  # the user insists: the handler before acts (Python's: raise)
                raise SystemExit("not raised")
            except KeyboardInterrupt:
                pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr[-3000:]


def test_the_ctrl_c_line_says_whether_there_is_a_checkpoint_to_resume(tmp_path):
    """Before, Ctrl-C before the first checkpoint suggested --resume latest, which then failed (no checkpoint)."""
    from common import exits, rundir
    exits.progress.step, exits.progress.hint = 3, lambda: rundir.resume_hint(str(tmp_path / "checkpoints"))
    try:
        assert exits.interrupted_line("grpo.py") == ("grpo.py: interrupted at step 3, before the run's first "
                                                     "checkpoint: nothing to resume; start it again with --overwrite")
        os.makedirs(tmp_path / "checkpoints" / "step_000002")
        os.makedirs(tmp_path / "checkpoints" / "step_000003.tmp")
        assert exits.interrupted_line("grpo.py") == ("grpo.py: interrupted at step 3; resume with --resume latest "
                                                     "(step 2)")
    finally:
        exits.progress.step, exits.progress.hint = 0, None


# A plug-in reward whose first call has the training process interrupted twice, 0.5 s apart, by a process of its own
# (a pidfd: the signal can never reach another process that took the pid over). The first Ctrl-C arrives while the
# step's reward checks are in flight, the second while the first is handled (or after the process ended): the outcome
# must be the same either way.
TWICE = '''
import os, signal, subprocess, sys, time
def score(response, answer):
    mark = os.environ["CTRL_C_MARK"]
    if not os.path.exists(mark):
        open(mark, "w").close()
        subprocess.Popen([sys.executable, "-c", (
            "import os, signal, time\\n"
            f"fd = os.pidfd_open({os.getppid()})\\n"
            "for _ in range(2):\\n"
            "    try:\\n"
            "        signal.pidfd_send_signal(fd, signal.SIGINT)\\n"
            "    except ProcessLookupError:\\n"
            "        break\\n"
            "    time.sleep(0.5)\\n")], start_new_session=True)
        time.sleep(3)
    return 1.0
'''


def test_a_second_ctrl_c_while_rewards_are_checked_changes_nothing(tmp_path):
    """Before: a second SIGINT while the first unwound the reward checks could end in `RuntimeError: release unlocked
    lock` (exit 1: Python's thread join, interrupted), and the checks killed on the way out were reported as failures
    after the one line. Now the first Ctrl-C kills the workers (the checks in flight return at once, unreported) and a
    second one ends the process at once: exit 130, the one line, nothing after it."""
    (tmp_path / "twice_rewards.py").write_text(TWICE)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), "--run-dir", str(tmp_path / "run"), *SMALL,
                        "--num-steps", "3", "--reward", "twice_rewards:score"], cwd=tmp_path,
                       env={**ENV, "CTRL_C_MARK": str(tmp_path / "mark")}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 130, p.stderr[-3000:]
    assert (tmp_path / "mark").exists()
    err = p.stderr.splitlines()
    said = [i for i, line in enumerate(err) if line.startswith("grpo.py:")]
    assert len(said) == 1, p.stderr[-3000:]
    assert not [line for line in err[said[0] + 1:] if line.strip()], p.stderr[-3000:]  # nothing after the line
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr
    assert err[said[0]].startswith("grpo.py: interrupted at step 1, before the run's first checkpoint")


# A plug-in reward whose first call sends the training process a Ctrl-C and then waits, in its worker, until that
# process is gone (a pidfd: never a process that took the pid over); a second Ctrl-C comes as the first one's handling
# kills the reward workers (tests/fault_injection.py reward-kill-sigint). No step of it depends on timing.
OUTLIVES = '''
import os, select, signal
def score(response, answer):
    try:
        os.close(os.open(os.environ["CTRL_C_MARK"], os.O_CREAT | os.O_EXCL))  # the first call only
    except FileExistsError:
        return 1.0
    trainer = os.pidfd_open(os.getppid())
    os.kill(os.getppid(), signal.SIGINT)
    select.select([trainer], [], [], 60)
    return 1.0
'''


def test_a_second_ctrl_c_while_the_workers_are_killed_ends_them_too(tmp_path):
    """Before: the second Ctrl-C ended the training process before it had killed its reward workers; the worker of
    the check in flight answered into the closed pipe and printed a BrokenPipeError traceback after the run's last
    line (seconds later, in a real run: when the check ended). Now the process kills them as it ends (and a worker
    that finds its trainer gone exits quietly)."""
    (tmp_path / "outlives.py").write_text(OUTLIVES)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fault_injection.py"), "grpo.py",
                        "reward-kill-sigint", "1", "--run-dir", str(tmp_path / "run"), *SMALL, "--num-steps", "2",
                        "--reward", "outlives:score"], cwd=tmp_path,
                       env={**ENV, "CTRL_C_MARK": str(tmp_path / "mark")}, capture_output=True, text=True,
                       timeout=600)  # (until every holder of its stderr, the workers too, is gone)
    assert p.returncode == 130, p.stderr[-3000:]
    assert (tmp_path / "mark").exists()
    err = p.stderr.splitlines()
    said = [i for i, line in enumerate(err) if line.startswith("grpo.py:")]
    assert len(said) == 1 and err[said[0]].startswith("grpo.py: interrupted at step 1,"), p.stderr[-3000:]
    assert not [line for line in err[said[0] + 1:] if line.strip()], p.stderr[-3000:]  # nothing after the line
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr


def test_a_worker_whose_trainer_is_gone_before_it_is_ready_exits_quietly():
    """Before: a reward worker started just before its trainer ended said "ready" into the closed pipe and printed a
    BrokenPipeError traceback (seen once in CI, after the test above's last line). Its replies and its "ready" go
    through one function that exits quietly when nobody is there."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tasks", "reward_pool.py"), "--worker"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the trainer's end of the pipe, gone before the worker says it is ready
    err = p.stderr.read()
    p.stdin.close()
    assert p.wait(timeout=300) == 0, err[-2000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# a full disk


def test_a_full_disk_when_the_log_is_written_stops_with_one_line_and_the_resume_repairs_the_log(tmp_path):
    """Before: `OSError: [Errno 28]` and a traceback (exit 1). Half of step 2's row reached the file (a torn row);
    the resume from step 1's checkpoint drops it and the log reads back whole."""
    p = inject("grpo.py", "log-enospc", 2, tmp_path, "--num-steps", "3")
    assert_one_line_error(p, 3, f"step 2: cannot write {tmp_path}/metrics.jsonl: no space left on {tmp_path} (No "
                                "space left on device)")
    text = open(tmp_path / "metrics.jsonl").read()
    assert not text.endswith("\n")  # the torn row
    assert checkpoints(tmp_path) == ["step_000001"]
    p = subprocess.run([sys.executable, "grpo.py", "--run-dir", str(tmp_path), *SMALL, "--num-steps", "3", "--resume",
                        "latest"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in rows(tmp_path) if "train/accuracy" in r] == [1, 2, 3]


class FillsUp(io.RawIOBase):
    """A file on a disk with `room` bytes left, written as the system call does: the write that reaches the end of
    the room writes what fits and returns that count, the next one raises ENOSPC. (Afterwards there is room again:
    another process freed some, so that what PyTorch's writer makes of it shows.)"""

    def __init__(self, f, room):
        self.f, self.room, self.state = f, room, "room"

    def writable(self):
        return True

    def write(self, b):
        if self.state == "room" and self.f.tell() + len(b) > self.room:
            self.state = "full"
            return self.f.write(bytes(b)[:self.room - self.f.tell()])
        if self.state == "full":
            self.state = "freed"
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
        return self.f.write(b)

    def tell(self):
        return self.f.tell()


def test_a_full_disk_while_the_optimizer_state_is_saved_is_named_as_likely(tmp_path, tiny_model_dir, process_group,
                                                                         monkeypatch):
    """torch.save turns the ENOSPC of a write into `RuntimeError: unexpected pos A vs B`, and DCP's gathering of the
    failure drops the OSError behind it: before, that was the whole message; now the line asks whether the disk is
    full, and the previous checkpoint stays the newest. The disk is full just where the first
    tensor of the optimizer's shard begins (after its plain values), so that torch.save meets it."""
    import contextlib
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from transformers import AutoTokenizer
    import common.checkpoint as ck
    from common.fsdp import load_policy
    _, _, device = process_group
    model = load_policy(tiny_model_dir, torch.float32, device, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    tokenizer, root = AutoTokenizer.from_pretrained(tiny_model_dir), str(tmp_path / "checkpoints")
    first = ck.save_checkpoint(root, 1, tokenizer, {"": (model, optimizer, {})}, ck.rng_state())
    with open(os.path.join(first, "optimizer", ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # (ours, just written)
    room = min(info.offset for key, info in metadata.storage_data.items()
               if not isinstance(metadata.state_dict_metadata[key.fqn], BytesStorageMetadata))
    create_stream = dcp_filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def filling_up(self, path, mode):
        with create_stream(self, path, mode) as f:
            yield FillsUp(f, room + 16) if str(path).endswith(".distcp") and "w" in mode else f
    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", filling_up)
    with pytest.raises(ck.CheckpointError) as e:
        ck.save_checkpoint(root, 2, tokenizer, {"": (model, optimizer, {})}, ck.rng_state())
    assert str(e.value).startswith(f"step 2: checkpoint {root}/step_000002 not saved: rank 0: RuntimeError: "), \
        str(e.value)
    assert str(e.value).endswith(f" (a write into {root}/step_000002.tmp fell short: is its disk full?)")
    assert "\n" not in str(e.value)
    assert ck.list_checkpoints(root) == [first]


# ---------------------------------------------------------------------------------------------------------------
# a plug-in reward whose module hangs at import


def test_a_plugin_that_hangs_at_import_stops_the_start_with_one_line(tmp_path):
    """Before: the run hung for ever, with no output (the module was imported in the training process, untimed).
    The import limit is 2 s here (IMPORT_TIMEOUT_S, set by the injection)."""
    (tmp_path / "hangs_on_import.py").write_text("import time\ntime.sleep(3600)\n\ndef score(r, a):\n    return 1.0\n")
    p = inject("grpo.py", "import-timeout", 1, tmp_path / "run", "--reward", "hangs_on_import:score", cwd=tmp_path)
    assert_one_line_error(p, 2, "--reward 'hangs_on_import:score': importing hangs_on_import did not finish within "
                                "2 s (IMPORT_TIMEOUT_S in tasks/reward_pool.py)")
    assert "Loading weights" not in p.stderr


def test_a_plugin_that_hangs_at_import_deaf_to_the_workers_timer_is_killed(tmp_path):
    """A module that blocks SIGALRM (the worker's timer) and waits: the worker is killed at the deadline."""
    (tmp_path / "deaf_on_import.py").write_text("import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, "
                                                "{signal.SIGALRM})\ntime.sleep(3600)\n")
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        sys.path.append({str(tmp_path)!r})
        from tasks import rewards
        from tasks import reward_pool
        reward_pool.IMPORT_TIMEOUT_S = 1.0
        try:
            rewards.check_reward("deaf_on_import:score")
        except ValueError as e:
            print(e)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("--reward 'deaf_on_import:score': importing deaf_on_import did not finish within 1 s"), \
        p.stdout + p.stderr[-2000:]

"""Runs an algorithm script with a fault injected from a given step on, for tests/test_faults.py:

    python tests/fault_injection.py SCRIPT MODE FROM_STEP [script args...]

MODE nan: every loss is NaN (a broken model or loss; in fp16, an overflow every step);
     reward: every other reward check raises; reward-all: every reward check raises (a broken reward function);
     mismatch: the sampler's log-probs are all lowered by 1 (a mismatch that jumps); nan-logprob: the sampler's
     log-probs of one response are NaN; save-enospc: rank 0's disk is full while it writes model.safetensors of the
     checkpoint of step FROM_STEP or later; save-sigint-<phase>: rank 0 gets a SIGINT (sent to itself, so at a known
     point) in a phase of the save of step FROM_STEP or later: rng (its RNG file), dcp (before the optimizer's
     shards), weights (before model.safetensors), rename (at the fsync after the rename); save-dcp-raise: rank 0's
     DCP writer raises KeyboardInterrupt (as a Ctrl-C landing inside DCP did before saves held it); log-enospc: the
     disk is full while metrics.jsonl gets the row of step FROM_STEP (half of the row is written: a torn row);
     save-sigint-<phase>-twice: two SIGINTs there; save-sigint-<phase>-at-exit: one there, the second in an atexit
     callback (the clean-up at exit); reward-kill-sigint: a SIGINT as a Ctrl-C's handling kills the reward workers;
     import-timeout: a plug-in's module must import within 2 s. Exits as the script's own __main__ does
     (common/exits.py: 2, 3, 130)."""
import atexit
import errno
import importlib
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common.checkpoint
import common.dist
import common.exits
import common.logger
import common.precision
import tasks.rewards
import common.hf_sampler

script, mode, from_step, argv = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
on = {"now": from_step <= 1}

log = common.logger.Logger.log
def log_and_arm(self, metrics, step, advance=True):  # noqa: E302
    log(self, metrics, step, advance)
    if advance and step + 1 >= from_step:
        on["now"] = True
common.logger.Logger.log = log_and_arm

if mode == "nan":
    scale_loss = common.precision.LossScaler.scale_loss
    common.precision.LossScaler.scale_loss = lambda self, loss: scale_loss(self, loss * float("nan") if on["now"] else loss)
elif mode == "reward":
    exact, calls = tasks.rewards._CHECKS["exact"], [0]
    def flaky(response, answer):  # noqa: E306
        calls[0] += 1
        if on["now"] and calls[0] % 2:
            raise RuntimeError("injected reward failure")
        return exact(response, answer)
    tasks.rewards._CHECKS["exact"] = flaky
elif mode == "reward-all":
    exact = tasks.rewards._CHECKS["exact"]
    def broken(response, answer):  # noqa: E306
        if on["now"]:
            raise RuntimeError("injected reward failure")
        return exact(response, answer)
    tasks.rewards._CHECKS["exact"] = broken
elif mode == "nan-logprob":  # the sampler reports a NaN log-prob (a forward that overflowed in 16 bits)
    generate = common.hf_sampler.HFSampler.generate
    def nan_first(self, *a, **k):  # noqa: E306
        out = generate(self, *a, **k)
        if on["now"] and out.logprobs:
            out.logprobs[0] = out.logprobs[0] * float("nan")
        return out
    common.hf_sampler.HFSampler.generate = nan_first
elif mode == "mismatch":
    generate = common.hf_sampler.HFSampler.generate
    def shifted(self, *a, **k):  # noqa: E306
        out = generate(self, *a, **k)
        if on["now"]:
            out.logprobs = [lp - 1.0 for lp in out.logprobs]
        return out
    common.hf_sampler.HFSampler.generate = shifted
elif mode == "save-enospc":
    write_safetensors = common.checkpoint.write_safetensors
    def full_disk(path, entries, tensors, *a, **k):  # noqa: E306
        step = int(os.path.basename(os.path.dirname(path)).split("_")[1].split(".")[0])  # step_000123.tmp
        if step < from_step or common.checkpoint.dist.get_rank() != 0:
            return write_safetensors(path, entries, tensors, *a, **k)
        def first_then_full():  # the first tensor fits, then the disk is full
            yield next(tensors)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return write_safetensors(path, entries, first_then_full(), *a, **k)
    common.checkpoint.write_safetensors = full_disk
elif mode.startswith("save-sigint-") or mode == "save-dcp-raise":
    saving = {"step": 0}
    save_checkpoint = common.checkpoint.save_checkpoint
    def save_and_note(root, step, *a, **k):  # noqa: E306
        saving["step"] = step
        return save_checkpoint(root, step, *a, **k)
    common.checkpoint.save_checkpoint = save_and_note

    def armed():
        return saving["step"] >= from_step and common.checkpoint.dist.get_rank() == 0

    presses = 2 if mode.endswith("-twice") else 1  # -twice: the user insists, inside the same save

    def ctrl_c():  # delivered before os.kill returns; Python runs the handler at the next bytecode
        for _ in range(presses):
            os.kill(os.getpid(), signal.SIGINT)
        if mode.endswith("-at-exit"):  # the second press during the clean-up at exit (a library's atexit callback
            atexit.register(os.kill, os.getpid(), signal.SIGINT)  # registered during the run runs before ours)
    phase = mode.removeprefix("save-sigint-").removesuffix("-twice").removesuffix("-at-exit")
    if phase == "rng":
        write_json = common.checkpoint.write_json
        def write_json_interrupted(path, *a, **k):  # noqa: E306
            if armed() and os.path.basename(path).startswith("rng_rank"):
                ctrl_c()
            return write_json(path, *a, **k)
        common.checkpoint.write_json = write_json_interrupted
    elif phase == "dcp":
        dcp_save = common.checkpoint.dcp.save
        def dcp_save_interrupted(*a, **k):  # noqa: E306
            if armed():
                ctrl_c()
            return dcp_save(*a, **k)
        common.checkpoint.dcp.save = dcp_save_interrupted
    elif phase == "weights":
        write_safetensors = common.checkpoint.write_safetensors
        def write_safetensors_interrupted(*a, **k):  # noqa: E306
            if armed():
                ctrl_c()
            return write_safetensors(*a, **k)
        common.checkpoint.write_safetensors = write_safetensors_interrupted
    elif phase == "rename":
        fsync_dir = common.checkpoint.fsync_dir
        def fsync_dir_interrupted(path):  # noqa: E306
            if armed() and os.path.basename(path) == "checkpoints":  # just after the rename into place
                ctrl_c()
            return fsync_dir(path)
        common.checkpoint.fsync_dir = fsync_dir_interrupted
    elif mode == "save-dcp-raise":
        import torch.distributed.checkpoint.filesystem as dcp_filesystem
        write_item = dcp_filesystem._write_item
        def write_item_interrupted(*a, **k):  # noqa: E306
            if armed():
                raise KeyboardInterrupt
            return write_item(*a, **k)
        dcp_filesystem._write_item = write_item_interrupted
    else:
        raise SystemExit(f"unknown mode {mode!r}")
elif mode == "log-enospc":
    write_row = common.logger.write_row
    def full_disk_row(file, data):  # noqa: E306
        if json.loads(data).get("step", 0) >= from_step and "train/accuracy" in json.loads(data):
            write_row(file, data[:len(data) // 2])  # part of the row fits, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_row(file, data)
    common.logger.write_row = full_disk_row
elif mode == "reward-kill-sigint":  # a second Ctrl-C as the first one's handling kills the reward workers
    import tasks.reward_pool
    kill_all = tasks.reward_pool.kill_all
    def kill_all_interrupted():  # noqa: E306
        os.kill(os.getpid(), signal.SIGINT)
        return kill_all()
    tasks.reward_pool.kill_all = kill_all_interrupted
elif mode == "import-timeout":
    import tasks.reward_pool
    tasks.reward_pool.IMPORT_TIMEOUT_S = 2.0
else:
    raise SystemExit(f"unknown mode {mode!r}")

module = importlib.import_module(script.removesuffix(".py"))
common.exits.run(lambda: module.main(module.parse_args(argv)), script)

"""Runs an algorithm script with a fault injected from a given step on, for tests/test_faults.py:

    python tests/fault_injection.py SCRIPT MODE FROM_STEP [script args...]

MODE nan: every loss is NaN (a broken model or loss; in fp16, an overflow every step);
     reward: every other reward check raises; reward-all: every reward check raises (a broken reward function);
     mismatch: the sampler's log-probs are all lowered by 1 (a mismatch that jumps); nan-logprob: the sampler's
     log-probs of one response are NaN; save-enospc: rank 0's disk is full while it writes model.safetensors of the
     checkpoint of step FROM_STEP or later. Exits as the script's own __main__ would: 3 on a TrainingFault."""
import errno
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common.checkpoint
import common.dist
import common.logger
import common.precision
import common.rewards
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
    exact, calls = common.rewards._CHECKS["exact"], [0]
    def flaky(response, answer):  # noqa: E306
        calls[0] += 1
        if on["now"] and calls[0] % 2:
            raise RuntimeError("injected reward failure")
        return exact(response, answer)
    common.rewards._CHECKS["exact"] = flaky
elif mode == "reward-all":
    exact = common.rewards._CHECKS["exact"]
    def broken(response, answer):  # noqa: E306
        if on["now"]:
            raise RuntimeError("injected reward failure")
        return exact(response, answer)
    common.rewards._CHECKS["exact"] = broken
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
else:
    raise SystemExit(f"unknown mode {mode!r}")

module = importlib.import_module(script.removesuffix(".py"))
try:
    module.main(module.parse_args(argv))
    common.dist.cleanup_distributed()  # as the scripts' __main__ does, after main()
except common.precision.TrainingFault as e:
    print(f"{script}: error: {e}", file=sys.stderr)
    sys.exit(3)

"""Runs an algorithm script's main() with what tests/test_wiring.py needs to see inside a step:

    python tests/wiring.py record OUT_JSON SCRIPT [args...]   # what the loss received, and what it returned
    python tests/wiring.py records RUNS_JSON   # several records in this process: a list of [OUT_JSON, SCRIPT, args...]
    torchrun --nproc_per_node N tests/wiring.py fixed SCRIPT [args...]   # a sampler that returns a fixed batch
    python tests/wiring.py fixed-each RUNS_JSON   # several fixed runs of one rank in this process: [SCRIPT, args...]
    python tests/wiring.py plain-each RUNS_JSON   # several plain runs (as `python SCRIPT args`) in this process
    python tests/wiring.py each OUT_JSON "SCRIPT args..." ["SCRIPT args..." ...]   # several runs, step 2 as --exact

SCRIPT: grpo.py or a sibling (tests/conftest.py SCRIPTS).
record: the sampler's mu is perturbed (a seeded +-1 nat per token, as tests/same_numbers.py does) so that the
rollout correction's weights are not 1, and every call of the script's policy_loss and of Corrections.weights is
recorded: the weights and normalizers the loss received (those of its arguments the script's loss has), the loss it
returned, the weights the correction computed (scripts with the rollout corrections); and which of the optional
features (exact.py, reward_model.py) the run imported (with records: the runs so far, a list that stays empty only
while none of them imports either).
fixed: every rank's sampler answers each prompt with responses that depend on the prompt alone (not on the rank, the
seed or the weights), with a fixed mu, so that 1 rank and N ranks train on the same global batch.
each: the runs one after the other in this process (one start-up for all), step 2's recompute skipped as --exact
skips it (common.cli.recompute_due); per run, how often the script loaded a reference (load_reference) and, in order,
each step-3 forward's micro-batches: the trainer's recompute ("old") and the reference's ("ref", the call without
stats)."""
import importlib
import inspect
import json
import os
import shlex
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import torch  # noqa: E402

import common.cli  # noqa: E402
import common.dist  # noqa: E402
import common.hf_sampler  # noqa: E402
import common.logprobs  # noqa: E402
import corrections  # noqa: E402
from common.batches import Rollout  # noqa: E402

NORMALIZERS = ("max_response_len", "num_seqs", "num_tokens")  # the constants a script's loss divides by


def script_module(script: str):
    return importlib.import_module(os.path.basename(script)[:-len(".py")])


def record(out_json: str, script: str, argv: list[str]) -> None:
    mod = script_module(script)
    calls = {"loss": [], "weights": []}
    generate = common.hf_sampler.HFSampler.generate
    n_calls = [0]

    def perturbed(self, *a, **k):
        out = generate(self, *a, **k)
        n_calls[0] += 1
        g = torch.Generator().manual_seed(n_calls[0])
        out.logprobs = [(lp + 2 * torch.rand(lp.shape, generator=g) - 1).clamp(max=0.0) for lp in out.logprobs]
        return out
    common.hf_sampler.HFSampler.generate = perturbed
    loss_fn, weights_fn = mod.policy_loss, corrections.Corrections.weights
    signature = inspect.signature(loss_fn)

    def loss(*a, **k):
        out = loss_fn(*a, **k)
        given = signature.bind(*a, **k).arguments
        mask_BT = given["mask_BT"]
        call = {"tokens": int(mask_BT.sum()), "loss": float(out[0])}
        if "weight_BT" in given:
            call["weight_sum"] = float((given["weight_BT"] * mask_BT).sum())
        call.update((name, float(given[name])) for name in NORMALIZERS if name in given)
        calls["loss"].append(call)
        return out

    def weights(self, stats, old_logp_BT, mu_logp_BT, mask_BT):
        w_BT = weights_fn(self, stats, old_logp_BT, mu_logp_BT, mask_BT)
        calls["weights"].append({"weight_sum": float((w_BT * mask_BT).sum()), "tokens": int(mask_BT.sum())})
        return w_BT
    mod.policy_loss, corrections.Corrections.weights = loss, weights
    try:
        mod.main(mod.parse_args(argv))
    finally:  # as they were, for the next run of this process (records)
        common.hf_sampler.HFSampler.generate, mod.policy_loss, corrections.Corrections.weights = \
            generate, loss_fn, weights_fn
        common.dist.cleanup_distributed()
    # the optional features the run imported (the scripts import exact.py and reward_model.py only when asked)
    calls["imported"] = sorted(name for name in ("exact", "reward_model") if name in sys.modules)
    with open(out_json, "w") as f:
        json.dump(calls, f)


class FixedSampler:
    """Answers each built-in-task prompt ("47+38=") with its sum for even response numbers and with digits drawn from a
    generator seeded by the prompt's ids and the response's number for odd ones (1 to 3 of them), so that rewards
    differ within a group; mu_logp -1 per token; every response counts as ended."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0):
        out = Rollout()
        for p in prompts:
            a, b = self.tokenizer.decode(p).rstrip("=").split("+")
            for j in range(n):
                g = torch.Generator().manual_seed(zlib.crc32(bytes(str((p, j)), "ascii")))
                digits = "".join(str(int(i)) for i in torch.randint(0, 10, (int(torch.randint(1, 4, (), generator=g)),),
                                                                       generator=g))
                ids = self.tokenizer.encode(str(int(a) + int(b)) if j % 2 == 0 else digits, add_special_tokens=False)
                k = len(ids)
                out.prompt_ids.append(p)
                out.response_ids.append(ids)
                out.logprobs.append(torch.full((k,), -1.0))
                out.finished.append(True)
        return out

    def load_weights(self, named_tensors):
        for _ in named_tensors:  # the gathers are collectives: every rank takes part in all of them
            pass

    def wake_up(self):
        pass

    def sleep(self):
        pass

    def shutdown(self):
        pass


def fixed(script: str, argv: list[str]) -> None:
    from transformers import AutoTokenizer
    mod = script_module(script)

    def make_sampler(flags, model_path, *a, **k):
        return FixedSampler(AutoTokenizer.from_pretrained(model_path))
    made = mod.make_sampler
    mod.make_sampler = make_sampler
    try:
        mod.main(mod.parse_args(argv))
    finally:  # as it was, for the next run of this process (fixed-each)
        mod.make_sampler = made
        common.dist.cleanup_distributed()


def plain(script: str, argv: list[str]) -> None:
    """The script's run as `python SCRIPT args` makes it (one of several in this process: plain-each)."""
    mod = script_module(script)
    try:
        mod.main(mod.parse_args(argv))
    finally:
        common.dist.cleanup_distributed()


def each(out_json: str, runs: list[str]) -> None:
    common.cli.recompute_due = lambda infra, step, first_step: step != 2  # as --exact skips it, on step 2
    recompute, out = common.logprobs.recompute_logprobs, []

    signature = inspect.signature(recompute)

    def counted(*a, **k):
        given = signature.bind(*a, **k).arguments
        out[-1]["forwards"].append(["ref" if given.get("stats") is None else "old", len(given["groups"])])
        return recompute(*a, **k)
    common.logprobs.recompute_logprobs = counted
    for cmd in runs:
        script, *argv = shlex.split(cmd)
        mod = script_module(script)
        load = mod.load_reference
        out.append({"run": cmd, "reference_loads": 0, "forwards": []})

        def loaded(*a, **k):
            out[-1]["reference_loads"] += 1
            return load(*a, **k)
        mod.load_reference = loaded
        try:
            mod.main(mod.parse_args(argv))
        finally:
            mod.load_reference = load
            common.dist.cleanup_distributed()
    with open(out_json, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "records":
        with open(sys.argv[2]) as f:
            for out, script, *argv in json.load(f):
                record(out, script, argv)
    elif sys.argv[1] in ("fixed-each", "plain-each"):
        with open(sys.argv[2]) as f:
            for script, *argv in json.load(f):
                (fixed if sys.argv[1] == "fixed-each" else plain)(script, argv)
    elif sys.argv[1] == "fixed":
        fixed(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "each":
        each(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)

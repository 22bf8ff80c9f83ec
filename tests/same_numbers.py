"""Runs an algorithm script for tests/test_same_numbers.py and writes what its run did, so that a restructuring of the
scripts can be checked to train the same and log the same:

    python tests/same_numbers.py run OUT_JSON SCRIPT [script args...]   # one run, its digest into OUT_JSON
    python tests/same_numbers.py record                                 # every case of CASES into REFERENCE

The run goes through the script's own parse_args and main, with two additions made here, not in the script:
- the fallback sampler's log-probs (mu) are perturbed by a fixed, seeded amount per token (up to 1 nat either way,
  the same on every machine), so that the mismatch metrics and every rollout correction see ratios that cross their
  bounds; the sampled tokens are untouched;
- every sampled batch's token ids are hashed (CRC-32 of the ids, per generate call), so that "the same sampled
  responses" is checked exactly.
The digest: metrics.jsonl's rows (without the time/, perf/ and mem/ keys, which are not numbers of the algorithm),
the sampled batches' hashes, and per tensor of the final checkpoint's model.safetensors its sum, sum of squares
and a dot product with a fixed random vector (a weight that moved anywhere changes the last).
"""
import importlib
import json
import os
import subprocess
import sys
import tempfile
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(ROOT, "tests", "data", "same_numbers.json")
SMALL = ["--num-steps", "3", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2", "--eval-every", "2",
         "--eval-max-problems", "16", "--save-every", "0", "--seed", "3"]
# (name, script, flags): every script, and the loop's branches (a weight, rejection rules and the veto, pi_old = mu
# and its first-mini-batch mismatch, a temperature other than 1, one mini-batch)
CASES = [
    ("grpo_tis_reject", "grpo.py", ["--is-correction", "token-tis", "--is-threshold", "2", "--is-reject", "token-mis",
                                    "k3-mis", "--k3-mis-threshold", "0.2", "--is-veto", "0.4"]),
    ("grpo_seqmis_temp", "grpo.py", ["--is-correction", "seq-mis", "--temperature", "0.7", "--num-minibatches", "1"]),
    ("grpo_mu_geo", "grpo.py", ["--old-logp", "mu", "--is-reject", "geo-mis", "opsm", "--geo-mis-bounds", "0.8",
                                "1.25"]),
    ("pg_is", "pg_is.py", []),
    ("pg_is_mis_first", "pg_is.py", ["--is-mode", "mis", "--mismatch-from", "first-minibatch"]),
    ("gspo", "gspo.py", []),
    ("ppo_seqtis", "ppo.py", ["--is-correction", "seq-tis"]),
    ("cispo_icepop", "cispo.py", ["--is-correction", "icepop"]),
]
SKIP_PREFIXES = ("time/", "perf/", "mem/")
PERTURB = 1.0  # the largest change of a token's mu_logp, nats (rho_t in [1/e, e]: some tokens and sequences cross
# the corrections' bounds)


def run(out_json: str, script: str, argv: list[str]) -> None:
    """In this process: the script's main() with the perturbed, hashed sampler; then the digest into out_json."""
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    import torch

    import common.dist
    import common.hf_sampler
    hashes = []
    generate = common.hf_sampler.HFSampler.generate

    def perturbed(self, *a, **k):
        out = generate(self, *a, **k)
        hashes.append(zlib.crc32(json.dumps(out.response_ids).encode()))
        g = torch.Generator().manual_seed(len(hashes))  # the call's number: the same perturbation on any machine
        out.logprobs = [(lp + PERTURB * (2 * torch.rand(lp.shape, generator=g) - 1)).clamp(max=0.0)
                        for lp in out.logprobs]
        return out
    common.hf_sampler.HFSampler.generate = perturbed
    module = importlib.import_module(script.removesuffix(".py"))
    module.main(module.parse_args(argv))
    common.dist.cleanup_distributed()
    run_dir = argv[argv.index("--run-dir") + 1]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(SKIP_PREFIXES)} for line in f]
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    with open(out_json, "w") as f:
        json.dump({"rows": rows, "sampled": hashes,
                   "weights": weight_digest(os.path.join(run_dir, "checkpoints", ckpts[-1], "model.safetensors"))},
                  f, indent=1)


def weight_digest(path: str) -> dict:
    """{tensor name: [numel, sum, sum of squares, dot with a fixed random vector]}, in float64."""
    import torch
    from safetensors.torch import load_file
    out = {}
    for name, t in sorted(load_file(path).items()):
        x = t.double().flatten()
        r = torch.rand(x.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 0.5
        out[name] = [x.numel(), float(x.sum()), float((x * x).sum()), float((x * r).sum())]
    return out


def run_case(name: str, script: str, flags: list[str], workdir: str) -> dict:
    """One case in a fresh process (one thread: the same arithmetic every time), its digest."""
    out_json = os.path.join(workdir, f"{name}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "tests", "same_numbers.py"), "run", out_json, script,
           "--run-dir", os.path.join(workdir, name), *SMALL, *flags]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    with open(out_json) as f:
        return json.load(f)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "record":
        with tempfile.TemporaryDirectory() as d:
            ref = {name: run_case(name, script, flags, d) for name, script, flags in CASES}
        os.makedirs(os.path.dirname(REFERENCE), exist_ok=True)
        with open(REFERENCE, "w") as f:
            json.dump(ref, f, indent=1)
        print(f"wrote {REFERENCE}")
    else:
        raise SystemExit(__doc__)

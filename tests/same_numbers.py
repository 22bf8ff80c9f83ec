"""Runs an algorithm script for tests/test_same_numbers.py and writes what its run did, so that a restructuring of the
scripts can be checked to train the same and log the same, on any machine:

    python tests/same_numbers.py run OUT_JSON RECORDED SCRIPT [script args...]   # one run, its digest into OUT_JSON
    python tests/same_numbers.py record [NAME ...]    # every case of CASES (or those named) into REFERENCE

Nothing that the test compares exactly may come from something built or trained on the machine, where another CPU
family rounds otherwise (the built-in task's model is trained at first use, so its weights and every token sampled
from it differ between machines). So the run goes through the script's own parse_args and main on the built-in task
(its train and eval problems, its tokenizer, its preset), with three changes made here, not in the script:
- its model is a fixed one (fixed_task): the built-in task's architecture with weights drawn as integers on a dyadic
  grid, the same bits on every machine, written into a task directory that BUILTIN_TASK_DIR points at;
- the fallback sampler does not draw its tokens: each response is forced token by token through its decoding loop
  (which computes mu, the log-prob of each token under the sampler's own weights at the run's temperature, as when it
  samples). `record` draws the responses from each problem by a seeded rule (drawn_response: the answer, a wrong
  answer, or no end, so that the rewards of a group differ); the test replays the recorded token ids (RECORDED, a
  JSON file of the case's recorded calls) and stops at the first call whose prompts are not those recorded;
- mu is perturbed by a fixed, seeded amount per token (up to 1 nat either way, the same on every machine), so that
  the mismatch metrics and every rollout correction see ratios that cross their bounds.
The digest: metrics.jsonl's rows (without the time/, perf/ and mem/ keys, which are not numbers of the algorithm),
every generate call's prompts (CRC-32 of their ids) and responses (token ids), and per tensor the update of the
weights, the final checkpoint's less the fixed model's: its squared norm, its sum and its dot product with a fixed
random vector (a weight that moved anywhere changes the last).
"""
import importlib
import json
import os
import random
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
WEIGHT_GRID = 2 ** -11  # the fixed model's weights are integers in [-64, 64] times this: |w| <= 1/32 (std 0.018,
# about transformers' initializer_range 0.02), each exact in any float format the run uses


def fixed_task(out_dir: str) -> str:
    """The built-in task with a fixed model in place of the trained one, built once into out_dir: the same problems
    (tasks/builtin.py make_datasets: a seeded Python generator), the same tokenizer and architecture, the weight
    matrices and embeddings drawn by torch.randint from a seeded generator (integers: the same on every machine; a
    normal draw is not, its vectorized log and cos differ between CPU families), the norms' weights 1 and the biases 0
    (transformers' own initialisation of those)."""
    import torch

    from tasks.builtin import build_model, build_tokenizer, make_datasets
    from tasks.cache import build_once, write_jsonl

    def build(tmp: str) -> None:
        train, evals = make_datasets()
        write_jsonl(os.path.join(tmp, "train.jsonl"), train)
        write_jsonl(os.path.join(tmp, "eval.jsonl"), evals)
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randint(-64, 65, p.shape, generator=g) * WEIGHT_GRID)
        model.save_pretrained(os.path.join(tmp, "model"))
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
    return build_once(out_dir, build)


def drawn_response(tokenizer, prompt_ids: list[int], call: int, j: int, max_new_tokens: int) -> list[int]:
    """A response to the problem "a+b=" drawn by a generator seeded with (generate call, prompt, response number):
    the answer (50%), the answer with one digit changed (25%), 1 to 3 random digits (10%), each ending in eos, or
    max_new_tokens random digits with no end (15%, a truncated response)."""
    rng = random.Random(zlib.crc32(json.dumps([call, prompt_ids, j]).encode()))
    a, b = tokenizer.decode(prompt_ids).rstrip("=").split("+")
    answer, u = str(int(a) + int(b)), rng.random()
    if u < 0.5:
        text = answer
    elif u < 0.75:
        i = rng.randrange(len(answer))
        text = answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + answer[i + 1:]
    elif u < 0.85:
        text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
    else:
        return tokenizer.encode("".join(rng.choice("0123456789") for _ in range(max_new_tokens)),
                                add_special_tokens=False)
    return (tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])[:max_new_tokens]


def force_responses(recorded: list[dict] | None, tokenizer) -> list[dict]:
    """Make the fallback sampler decode given responses instead of drawing them: every generate call's responses are
    the recorded ones (recorded: [{"prompts": CRC-32, "responses": ["id id ...", ...]}] per call), or drawn_response's
    when recorded is None. Returns the list into which each call's {"prompts", "responses"} goes."""
    import torch

    from common.hf_sampler import HFSampler, process_logits
    calls = []
    generate, generate_batch = HFSampler.generate, HFSampler._generate_batch

    def forced_generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0):
        k = len(calls)
        flat = [p for p in prompts for _ in range(n)]
        crc = zlib.crc32(json.dumps(flat).encode())
        if recorded is None:
            targets = [drawn_response(tokenizer, p, k, i % n, max_new_tokens) for i, p in enumerate(flat)]
        elif k >= len(recorded) or recorded[k]["prompts"] != crc:
            raise RuntimeError(f"generate call {k}: other prompts than recorded (or more calls)")
        else:
            targets = [[int(t) for t in r.split()] for r in recorded[k]["responses"]]
        self._targets = targets  # taken chunk by chunk by forced_batch
        out = generate(self, prompts, n, max_new_tokens, temperature, top_p)
        if out.response_ids != [t[:max_new_tokens] for t in targets]:
            raise RuntimeError(f"generate call {k}: the sampler did not return the responses it was given")
        calls.append({"prompts": crc, "responses": [" ".join(map(str, r)) for r in out.response_ids]})
        g = torch.Generator().manual_seed(len(calls))  # the call's number: the same perturbation on any machine
        out.logprobs = [(lp + PERTURB * (2 * torch.rand(lp.shape, generator=g) - 1)).clamp(max=0.0)
                        for lp in out.logprobs]
        return out

    def forced_batch(self, prompts, max_new_tokens, temperature, top_p):
        targets, self._targets = self._targets[:len(prompts)], self._targets[len(prompts):]
        # rows x max_new_tokens, eos after each response's end (the loop stops reading a row at its first eos)
        forced = torch.full((len(prompts), max_new_tokens), int(self.eos_ids[0]), dtype=torch.long)
        for b, t in enumerate(targets):
            forced[b, :len(t)] = torch.tensor(t[:max_new_tokens], dtype=torch.long)
        self._forced, self._t = forced.to(self.device), 0
        return generate_batch(self, prompts, max_new_tokens, temperature, top_p)

    def forced_sample(self, logits_BV, temperature, top_p):
        """The forced token of every row and its fp32 log-prob under the processed distribution (as _sample)."""
        logp_BV = process_logits(logits_BV.float(), temperature, top_p)
        tok_B = self._forced[:, self._t]
        self._t += 1
        return tok_B, logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)
    HFSampler.generate, HFSampler._generate_batch, HFSampler._sample = forced_generate, forced_batch, forced_sample
    return calls


def run(out_json: str, recorded_json: str, script: str, argv: list[str]) -> None:
    """In this process: the fixed task, the forced sampler, the script's main(); then the digest into out_json."""
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    import common.dist
    from tasks.builtin import build_tokenizer
    task = fixed_task(os.path.join(os.path.dirname(os.path.abspath(out_json)), "task"))
    os.environ["BUILTIN_TASK_DIR"] = task  # the script's built-in task is the fixed one
    recorded = None
    if recorded_json != "-":
        with open(recorded_json) as f:
            recorded = json.load(f)
    calls = force_responses(recorded, build_tokenizer())
    module = importlib.import_module(script.removesuffix(".py"))
    module.main(module.parse_args(argv))
    common.dist.cleanup_distributed()
    run_dir = argv[argv.index("--run-dir") + 1]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(SKIP_PREFIXES)} for line in f]
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    with open(out_json, "w") as f:
        json.dump({"rows": rows, "sampled": calls,
                   "weights": update_digest(os.path.join(run_dir, "checkpoints", ckpts[-1], "model.safetensors"),
                                            os.path.join(task, "model", "model.safetensors"))},
                  f, indent=1)


def update_digest(path: str, start: str) -> dict:
    """{tensor name: [numel, |update|^2, sum of the update, dot of the update with a fixed random vector]}, in
    float64, the update being the checkpoint's weights (path) less the fixed model's (start): a weight that moved
    anywhere changes the last."""
    import torch
    from safetensors.torch import load_file
    out, w0 = {}, load_file(start)
    for name, t in sorted(load_file(path).items()):
        x = (t.double() - w0[name].double()).flatten()
        r = torch.rand(x.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 0.5
        out[name] = [x.numel(), float((x * x).sum()), float(x.sum()), float((x * r).sum())]
    return out


def run_case(name: str, script: str, flags: list[str], workdir: str, recorded: list[dict] | None = None) -> dict:
    """One case in a fresh process (on one thread unless OMP_NUM_THREADS says otherwise), its digest. recorded: the
    calls to replay (the reference's "sampled"); None draws the responses (record)."""
    out_json = os.path.join(workdir, f"{name}.json")
    recorded_json = "-"
    if recorded is not None:
        recorded_json = os.path.join(workdir, f"{name}.recorded.json")
        with open(recorded_json, "w") as f:
            json.dump(recorded, f)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "tests", "same_numbers.py"), "run", out_json, recorded_json, script,
           "--run-dir", os.path.join(workdir, name), *SMALL, *flags]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(f"{name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    with open(out_json) as f:
        return json.load(f)


def record(names: list[str], reference: str, workdir: str) -> None:
    """Record the cases named (all of CASES when none is) into the reference file. Naming some (a new case, a
    fork's) keeps the others' recordings as they are."""
    unknown = sorted(set(names) - {c[0] for c in CASES})
    if unknown:
        raise SystemExit(f"no such case: {' '.join(unknown)} (CASES: {' '.join(c[0] for c in CASES)})")
    ref = {}
    if names and os.path.exists(reference):
        with open(reference) as f:
            ref = json.load(f)
    ref.update({name: run_case(name, script, flags, workdir) for name, script, flags in CASES
                if name in (names or [name])})
    os.makedirs(os.path.dirname(reference), exist_ok=True)
    with open(reference, "w") as f:
        json.dump(ref, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    elif sys.argv[1] == "record":
        with tempfile.TemporaryDirectory() as d:
            record(sys.argv[2:], REFERENCE, d)
        print(f"wrote {REFERENCE}")
    else:
        raise SystemExit(__doc__)

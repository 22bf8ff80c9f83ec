"""grpo.py end to end on the built-in task, on CPU: under torchrun with 2 processes and as a single process. The
loss and metrics are finite, checkpoints reload with from_pretrained, bad input fails before a model loads."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from early_exit import early_exits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--num-steps", "2", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2",
         "--micro-batch-tokens", "96", "--eval-every", "1", "--eval-k", "2", "--eval-max-problems", "8",
         "--save-every", "1", "--keep-last", "1"]


def run(cmd, **kw):
    # CPU runs (two ranks cannot share one GPU under NCCL); tests/test_gpu.py covers the GPU
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, **kw)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("nproc,extra", [(2, ["--precision", "fp16", "--is-correction", "token-tis"]),
                                         (1, ["--precision", "bf16", "--is-correction", "seq-mis"])])
def test_grpo_runs_and_checkpoint_reloads(tmp_path, nproc, extra):
    run_dir = str(tmp_path / "run")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    p = run(launcher + ["grpo.py", "--run-dir", run_dir, *SMALL, *extra])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "train/accuracy" in r]
    evals = [r for r in rows if "eval/eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 1, 2]
    for r in steps:
        for key in ["train/loss", "mismatch/kl_k3", "mismatch/kl_k1", "optim/grad_norm", "policy/approx_kl",
                    "is/ratio_mean", "train/entropy", "perf/train_tok_s"]:
            assert math.isfinite(r[key]), (key, r[key])
        assert r["mismatch/kl_k3"] >= 0 and 0 <= r["train/accuracy"] <= 1
    # --keep-last 1: only the final checkpoint is left, and it is a Hugging Face model directory
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ckpts == ["step_000002"]
    path = os.path.join(run_dir, "checkpoints", ckpts[0])
    model = AutoModelForCausalLM.from_pretrained(path)
    # the parameter count logged is the model's (a DTensor's numel is already the full size: not times the ranks)
    assert f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters" in p.stdout, p.stdout[-2000:]
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode(tok.encode("12+3="), skip_special_tokens=True) == "12+3="
    ids = torch.tensor([tok.encode("12+3=")])
    assert torch.isfinite(model(ids).logits).all()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, as the built-in model is


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """grpo.py with SMALL and nothing else, run once: the run that test_cpu_offload_changes_nothing_on_cpu compares
    with --cpu-offload and that test_training_moves_the_weights_and_resume_continues resumes (in a copy)."""
    run_dir = str(tmp_path_factory.mktemp("plain") / "run")
    p = run([sys.executable, "grpo.py", "--run-dir", run_dir, *SMALL])
    assert p.returncode == 0, p.stderr[-3000:]
    return run_dir


def test_training_moves_the_weights_and_resume_continues(tmp_path, plain_run):
    run_dir = str(shutil.copytree(plain_run, tmp_path / "run"))  # (a copy: the resume adds to it, others read it)
    p = run([sys.executable, "grpo.py", "--run-dir", run_dir, *SMALL, "--num-steps", "3", "--resume", "latest"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[resume]" in p.stdout and "step 2" in p.stdout
    steps = [r["step"] for r in read_metrics(run_dir) if "train/accuracy" in r]
    assert steps == [1, 2, 3]
    from tasks.builtin import ensure_builtin_task
    start = AutoModelForCausalLM.from_pretrained(ensure_builtin_task()["model"])
    end = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", "step_000003"))
    assert not torch.equal(start.model.embed_tokens.weight, end.model.embed_tokens.weight)


def test_cpu_offload_changes_nothing_on_cpu(tmp_path, plain_run):
    """grpo.py --cpu-offload (FSDP2 CPUOffloadPolicy; on a CPU the weights are already there): the same metrics, step
    for step, and the same checkpoint as without, through the weight sync, evaluation and the checkpoint's gathers."""
    keys = ["train/accuracy", "train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", "train/entropy"]
    metrics, weights = {}, {}
    for name, run_dir in (("plain", plain_run), ("offload", str(tmp_path / "offload"))):
        if name == "offload":
            p = run([sys.executable, "grpo.py", "--run-dir", run_dir, *SMALL, "--cpu-offload"])
            assert p.returncode == 0, p.stderr[-3000:]
        metrics[name] = [[r[k] for k in keys] for r in read_metrics(run_dir) if "train/accuracy" in r]
        path = os.path.join(run_dir, "checkpoints", "step_000002")
        weights[name] = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert len(metrics["offload"]) == 2 and metrics["offload"] == metrics["plain"]
    for name, t in weights["plain"].items():
        assert torch.equal(t, weights["offload"][name]), name


def test_builtin_accuracy_rises(tmp_path):
    """The built-in task's point: GRPO visibly improves the warm-started model within a minute on a CPU."""
    run_dir = str(tmp_path / "run")
    p = run([sys.executable, "grpo.py", "--run-dir", run_dir, "--num-steps", "40", "--eval-every", "0",
             "--save-every", "0"])
    assert p.returncode == 0, p.stderr[-3000:]
    acc = [r["train/accuracy"] for r in read_metrics(run_dir) if "train/accuracy" in r]
    first, last = sum(acc[:8]) / 8, sum(acc[-8:]) / 8
    assert last > first + 0.1, (first, last)


BAD_DATA = {"empty.jsonl": "", "norow.jsonl": '{"problem": "1+1="}\n', "broken.jsonl": '{"problem": "1+1=", \n',
            "ok.jsonl": '{"problem": "1+1=", "answer": "2"}\n'}


BAD_INPUT = [
    (["--model", "/nonexistent/model"], "no such directory"),
    (["--dataset", "/nonexistent.jsonl"], "no such file"),
    (["--dataset", "{tmp}/empty.jsonl"], "the dataset is empty"),
    (["--dataset", "{tmp}/norow.jsonl"], "line 1: missing the answer"),
    (["--dataset", "{tmp}/broken.jsonl"], "line 1: invalid JSON"),
    (["--dataset", "{tmp}/ok.jsonl", "--max-prompt-len", "2"], "all 1 prompts are longer than 2 tokens"),
    (["--num-prompts", "10", "--num-minibatches", "4"], "--num-minibatches 4 does not divide"),
    (["--top-p", "0.9"], "top-p must be 1.0"),
    (["--precision", "fp8"], "fp8"),
    (["--sampler", "vllm"] if importlib.util.find_spec("vllm") is None else ["--vllm-tp", "3"], "vllm"),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """grpo.py on each of BAD_INPUT's command lines (each its own --run-dir), all in one early_exits."""
    tmp = tmp_path_factory.mktemp("bad_input")
    for name, text in BAD_DATA.items():
        (tmp / name).write_text(text)
    cases = [("grpo.py", ["--run-dir", str(tmp / f"run{i}"), *[a.replace("{tmp}", str(tmp)) for a in args]])
             for i, (args, _) in enumerate(BAD_INPUT)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return early_exits(cases, str(tmp), env)


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(args) for args, _ in BAD_INPUT])
def test_bad_input_fails_fast_with_a_clear_error(bad_input_runs, case):
    p, message = bad_input_runs[case], BAD_INPUT[case][1]
    assert p.returncode == 2
    assert message in p.stderr.lower() if message == "vllm" else message in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert "Loading weights" not in p.stderr  # failed before any model was loaded

"""Sharded checkpoints (common/checkpoint.py) under torchrun on CPU: each rank writes its shard of the AdamW state,
rank 0 streams the weights into a Hugging Face directory, and a run resumes on another number of ranks with the
very state that was saved. A run directory that not every rank sees is refused at the start."""
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_tiny_model_dir
from test_fsdp import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("saved_on,resumed_on", [(2, [1, 3]), (1, [2])])
def test_resume_on_another_number_of_ranks_restores_the_saved_state(tmp_path, saved_on, resumed_on):
    path = make_tiny_model_dir(str(tmp_path / "m"), tie=False)
    saved = torchrun(saved_on, "save", path, str(tmp_path / "save"))[0]
    ckpt = os.path.join(path, "checkpoints", "step_000001")
    files = sorted(os.listdir(os.path.join(ckpt, "optimizer")))
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(saved_on)]  # one shard per rank
    assert not os.path.exists(os.path.join(ckpt, "optimizer.pt"))
    # the Hugging Face directory: the weights the run had (the first number of each summary), streamed by rank 0
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for name, p in hf.named_parameters():
        assert p.double().sum().item() == saved["lm." + name][0]
    for n in resumed_on:
        for r in torchrun(n, "resume", ckpt, str(tmp_path / f"resume{n}")):
            assert r == saved  # weights, both AdamW moments and the step count, exactly


def test_checkpoint_of_an_offloaded_run_resumes_with_and_without_offload(tmp_path):
    """--cpu-offload: the AdamW state (shards on the CPU) saved on 2 ranks is restored exactly on 1 rank with offload
    and on 2 without."""
    path = make_tiny_model_dir(str(tmp_path / "m"), tie=False)
    saved = torchrun(2, "save_offload", path, str(tmp_path / "save"))[0]
    ckpt = os.path.join(path, "checkpoints", "step_000001")
    assert torchrun(1, "resume_offload", ckpt, str(tmp_path / "resume1"))[0] == saved
    for r in torchrun(2, "resume", ckpt, str(tmp_path / "resume2")):
        assert r == saved


def test_run_dir_not_seen_by_every_rank_is_refused(tmp_path):
    for r in torchrun(2, "shared_dir", str(tmp_path / "run"), str(tmp_path / "out")):
        assert r["refused"] and "shared filesystem" in r["refused"]


def test_an_optimizer_state_that_does_not_fit_is_a_one_line_error(tmp_path, process_group):
    """DCP's CheckpointException is a BaseException (the scripts' one-line handler missed it) whose message is every
    rank's traceback: loading a tied model's AdamW state into an untied model's optimizer (which wants a state for
    lm_head too) is a ValueError of one line."""
    from common.checkpoint import load_training_state, rng_state, save_checkpoint
    from common.fsdp import load_policy
    from common.logprobs import collate
    from transformers import AutoTokenizer
    _, _, device = process_group
    runs = {}
    for tie in (True, False):
        path = make_tiny_model_dir(str(tmp_path / f"m{tie}"), tie=tie)
        model = load_policy(path, torch.float32, device, gradient_checkpointing=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        logp, _ = model(*collate([[4, 5]], [[6, 7]], 0, device), 1.0, 16)
        (-logp.sum()).backward()
        optimizer.step()
        runs[tie] = (path, model, optimizer)
    path, model, optimizer = runs[True]
    ckpt = save_checkpoint(str(tmp_path / "ckpt"), 1, AutoTokenizer.from_pretrained(path), {"": (model, optimizer, {})},
                           rng_state())
    _, model, optimizer = runs[False]
    with pytest.raises(ValueError) as e:
        load_training_state(ckpt, model, optimizer)
    assert "lm_head" in str(e.value) and "\n" not in str(e.value), str(e.value)


class RunsCode:
    """A pickle that, when loaded, creates the directory `marker`: what a shared checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_rng_state_round_trips_through_json(process_group):
    import json
    from common.checkpoint import rng_from_json, rng_state, rng_to_json, set_rng_state
    import random
    import numpy as np
    g = torch.Generator().manual_seed(3)
    saved = json.loads(json.dumps(rng_to_json(rng_state(g))))
    draws = [random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=g).item()]
    set_rng_state(rng_from_json(saved), g)
    assert [random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=g).item()] == draws


def test_an_empty_rng_state_round_trips():
    """ppo.py saves its critic's checkpoint with no random streams ({}): written and read back as {}."""
    import json
    from common.checkpoint import rng_from_json, rng_to_json
    assert rng_from_json(json.loads(json.dumps(rng_to_json({})))) == {}


def test_resume_does_not_unpickle_the_rng_files(tmp_path, process_group):
    """A checkpoint's rng_rank0.pt that runs code when unpickled (resume loaded it with weights_only=False): not
    read; the RNG state comes from rng_rank0.json only."""
    import json
    from common.checkpoint import load_training_state
    ckpt, marker = tmp_path / "step_000001", tmp_path / "pwned"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    torch.save(RunsCode(str(marker)), ckpt / "rng_rank0.pt")
    state, rank_state = load_training_state(str(ckpt), None, None)
    assert state["step"] == 1 and rank_state == {}
    assert not marker.exists()


def test_a_checkpoint_as_model_is_read_as_safetensors_and_json_only(tmp_path):
    """--model <checkpoint dir>: grpo.py trains a step from a model directory that also holds pickles which run code
    when loaded (DCP's optimizer/.metadata, an old rng_rank0.pt, a pytorch_model.bin and training_args.bin beside
    the safetensors): none of them is loaded."""
    import json
    path = make_tiny_model_dir(str(tmp_path / "m"))
    marker = tmp_path / "pwned"
    os.makedirs(os.path.join(path, "optimizer"))
    for name in ("optimizer/.metadata", "rng_rank0.pt", "pytorch_model.bin", "training_args.bin"):
        with open(os.path.join(path, name), "wb") as f:
            pickle.dump(RunsCode(str(marker)), f)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"problem": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                                                  for a in range(8)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "grpo.py", "--model", path, "--dataset", str(tmp_path / "train.jsonl"),
                        "--run-dir", str(tmp_path / "run"), "--prompt-template", "{problem}", "--reward", "exact",
                        "--max-prompt-len", "16", "--max-response-len", "4", "--precision", "fp32", "--num-steps", "1",
                        "--num-prompts", "4", "--group-size", "2", "--num-minibatches", "1", "--eval-every", "0"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not marker.exists()


def test_a_write_that_fails_on_one_rank_stops_every_rank_with_the_same_line(tmp_path):
    """2 ranks; in turn rank 0's model.safetensors, rank 1's RNG file, rank 1's DCP shard and rank 0's rename fail
    with ENOSPC. Before, the failing rank raised alone and the others waited in the next collective (the all-gather
    of the weights, a barrier) until the timeout. Now every rank raises the same CheckpointError naming the failing
    rank, the failed steps are never complete checkpoints, and the group goes on working (the last save succeeds)."""
    path = make_tiny_model_dir(str(tmp_path / "m"))
    results = torchrun(2, "save_faults", path, str(tmp_path / "out"))
    assert results[0] == results[1]  # the same lines on both ranks
    errors = results[0]["errors"]
    for step, (rank, file) in enumerate([(0, "model.safetensors"), (1, "rng_rank1.json"), (1, ".distcp"),
                                         (0, "step_000004")], start=1):
        assert errors[step - 1].startswith(f"step {step}: checkpoint "), errors
        assert f"rank {rank}: OSError: [Errno 28] No space left on device" in errors[step - 1], errors
        assert file in errors[step - 1] and "\n" not in errors[step - 1], errors
    assert results[0]["checkpoints"] == ["step_000005"]  # the failed saves are no checkpoints: latest skips them
    assert "step_000004" not in results[0]["entries"]


def test_checkpoint_is_fsynced_before_the_rename_and_pruning_comes_after(tmp_path, tiny_model_dir, process_group,
                                                                          monkeypatch):
    """Crash durability: before, nothing but DCP's own files was fsynced, so after a power loss the renamed (hence
    complete-looking) checkpoint could hold a truncated model.safetensors while --keep-last had already deleted the
    previous one. Now every file and directory of the checkpoint is fsynced before os.replace puts it in place, the
    parent directory after it (the rename itself), and only then is the older checkpoint pruned. os.fsync, os.replace
    and shutil.rmtree are recorded in order; a file is named by its inode, which the rename keeps."""
    from transformers import AutoTokenizer
    import common.checkpoint as ck
    from common.fsdp import load_policy
    _, _, device = process_group
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    tokenizer, root = AutoTokenizer.from_pretrained(tiny_model_dir), str(tmp_path / "checkpoints")
    ck.save_checkpoint(root, 1, tokenizer, {"": (model, optimizer, {})}, ck.rng_state())
    events, fsync, replace, rmtree = [], os.fsync, os.replace, shutil.rmtree
    inode = lambda st: (st.st_dev, st.st_ino)  # noqa: E731

    def record_fsync(fd):
        events.append(("fsync", inode(os.fstat(fd))))
        fsync(fd)

    def record_replace(src, dst):
        replace(src, dst)
        events.append(("replace", str(dst)))

    def record_rmtree(path, *a, **k):
        events.append(("rmtree", str(path)))
        rmtree(path, *a, **k)
    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    monkeypatch.setattr(shutil, "rmtree", record_rmtree)
    final = ck.save_checkpoint(root, 2, tokenizer, {"": (model, optimizer, {})}, ck.rng_state(), keep_last=1)
    monkeypatch.undo()
    rename = events.index(("replace", final))
    synced_before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    written = [os.path.join(d, n) for d, dirs, files in os.walk(final) for n in files + dirs] + [final]
    assert len(written) > 8  # model.safetensors, configs, tokenizer files, trainer_state, rng, optimizer/, shards
    for path in written:
        assert inode(os.stat(path)) in synced_before, f"{os.path.relpath(path, root)} not fsynced before the rename"
    parent_synced = events.index(("fsync", inode(os.stat(root))), rename)  # (ValueError: never after the rename)
    pruned = events.index(("rmtree", os.path.join(root, "step_000001")))
    assert rename < parent_synced < pruned
    assert [os.path.basename(c) for c in ck.list_checkpoints(root)] == ["step_000002"]


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_resume_from_an_older_step_sets_the_later_checkpoints_aside(tmp_path, script):
    """A run saved steps 5, 10, 15 (--keep-last 3) and is resumed from step 5, to step 8, saving every step. Before,
    --keep-last sorted by step across both lines (5, 6, 10, 15 -> 6, 10, 15; then 7, 10, 15; then 8, 10, 15) and
    --resume latest took the abandoned step 15. Now, at resume, 10 and 15 are moved into checkpoints/abandoned_<time>/
    (not deleted), so keep-last prunes the new line only (6, 7, 8) and latest is step 8. ppo.py: its critic, inside
    each step's folder, goes with it."""
    from common.checkpoint import find_resume_dir, list_checkpoints
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    small = ["--run-dir", str(tmp_path), "--num-prompts", "4", "--group-size", "2", "--num-minibatches", "1",
             "--eval-every", "0", "--keep-last", "3"]

    def run(*args):
        p = subprocess.run([sys.executable, script, *small, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout
    run("--num-steps", "15", "--save-every", "5")
    roots = ["checkpoints"]
    steps = lambda root: [os.path.basename(c) for c in list_checkpoints(str(tmp_path / root))]  # noqa: E731
    assert [steps(root) for root in roots] == [["step_000005", "step_000010", "step_000015"]] * len(roots)
    out = run("--num-steps", "8", "--save-every", "1", "--resume", str(tmp_path / "checkpoints" / "step_000005"))
    for root in roots:
        assert steps(root) == ["step_000006", "step_000007", "step_000008"], (root, steps(root))
        aside = [d for d in os.listdir(tmp_path / root) if d.startswith("abandoned_")]
        log = ["metrics.jsonl"]  # the later rows of the log
        assert len(aside) == 1 and sorted(os.listdir(tmp_path / root / aside[0])) == log + ["step_000010",
                                                                                           "step_000015"]
        assert "held checkpoints after step 5 (10, 15)" in out and f"moved into {tmp_path / root / aside[0]}" in out
        if script == "ppo.py":
            assert all(os.path.isfile(tmp_path / root / d / "critic" / "trainer_state.json")
                       for d in [*steps(root), f"{aside[0]}/step_000010", f"{aside[0]}/step_000015"])
    assert find_resume_dir("latest", str(tmp_path / "checkpoints")).endswith("step_000008")

"""Sharded checkpoints (common/checkpoint.py) under torchrun on CPU: each rank writes its shard of the AdamW state,
rank 0 streams the weights into a Hugging Face directory, and a run resumes on another number of ranks with the
very state that was saved. A run directory that not every rank sees is refused at the start."""
import os
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
    ckpt = save_checkpoint(str(tmp_path / "ckpt"), 1, model, model.lm, AutoTokenizer.from_pretrained(path), optimizer,
                           {}, rng_state())
    _, model, optimizer = runs[False]
    with pytest.raises(ValueError) as e:
        load_training_state(ckpt, model, optimizer)
    assert "lm_head" in str(e.value) and "\n" not in str(e.value), str(e.value)

"""Checkpoints: a Hugging Face model directory (config, generation config, tokenizer, model.safetensors) that
`from_pretrained` and vLLM load, plus what resuming needs: optimizer.pt (full, fp32), trainer_state.json (step,
loss scaler, ...) and rng_rank{r}.pt (each rank's RNG streams, the sampler's among them).

A checkpoint is written to `<name>.tmp` and renamed into place only when complete, so a run killed mid-save keeps
its previous checkpoint. Directories are `step_000123`; the newest complete one is what `--resume latest` takes.
"""
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state(generator: torch.Generator | None = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if generator is not None:
        state["sampler"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if generator is not None and "sampler" in state:
        generator.set_state(state["sampler"])


def save_checkpoint(ckpt_root: str, step: int, model: torch.nn.Module, lm: torch.nn.Module, tokenizer,
                    optimizer: torch.optim.Optimizer | None, trainer_state: dict, rank_state: dict,
                    keep_last: int = 0) -> str:
    """Collective: every rank calls it. `model` is the FSDP root, `lm` the Hugging Face model inside it."""
    rank = dist.get_rank()
    final = os.path.join(ckpt_root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd = get_model_state_dict(model, options=FULL)  # full tensors on rank 0's CPU, empty elsewhere
    optim_sd = get_optimizer_state_dict(model, optimizer, options=FULL) if optimizer is not None else None
    torch.save(rank_state, os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        prefix = next(n for n, m in model.named_children() if m is lm) + "."
        sd = {k[len(prefix):]: v.contiguous() for k, v in model_sd.items() if k.startswith(prefix)}
        if getattr(lm.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)  # stored once, as the embedding (what from_pretrained and vLLM expect)
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        lm.config.save_pretrained(tmp)
        if lm.generation_config is not None:
            lm.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if optim_sd is not None:
            torch.save(optim_sd, os.path.join(tmp, "optimizer.pt"))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, **trainer_state}, f, indent=2)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep_last > 0:
            for old in list_checkpoints(ckpt_root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(ckpt_root: str) -> list[str]:
    """Complete checkpoints, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    steps = sorted((int(m.group(1)), d) for d in os.listdir(ckpt_root) if (m := STEP_DIR.match(d)))
    return [os.path.join(ckpt_root, d) for _, d in steps]


def find_resume_dir(resume: str, ckpt_root: str) -> str:
    path = resume
    if resume == "latest":
        found = list_checkpoints(ckpt_root)
        if not found:
            raise FileNotFoundError(f"--resume latest: no checkpoint in {ckpt_root}")
        path = found[-1]
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"--resume {resume!r}: {path} is not a complete checkpoint (no trainer_state.json)")
    return path


def load_training_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """Optimizer state (read on rank 0, broadcast), trainer_state.json and this rank's RNG state. The weights come
    from loading `path` as the model directory."""
    rank = dist.get_rank()
    if optimizer is not None:
        optim_sd = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False) if rank == 0 else {}
        set_optimizer_state_dict(model, optimizer, optim_sd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with open(os.path.join(path, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    rank_state = torch.load(rng_file, weights_only=False) if os.path.exists(rng_file) else {}
    return trainer_state, rank_state

"""What every script shares on its command line: the Infra flags, their ranges, the built-in task's preset, exits."""
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Literal

import tyro

from common import exits
from common.config import _show, config_changes, flat_fields, run_config  # noqa: F401 (the scripts' start-up line)
from common.preflight import check_model_dir
from common.sampler import resolve_sampler


@dataclass
class Infra:
    """How a run is carried out, not what it computes: the same flags in every script (common/cli.py)."""
    # --- run
    run_dir: str | None = None
    """where metrics.jsonl, config.json and checkpoints/ go (default: runs/<exp_name>_<seed>)"""
    track: bool = False
    """log to Weights & Biases too (offline mode when no account is configured)"""
    wandb_project: str = "rl-mismatch"
    """the wandb project"""
    # --- the sampler's implementation
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """'vllm': an in-process vLLM engine per rank; 'hf': the fallback on transformers (a copy of the policy); 'auto':
    vllm when it is installed and a GPU is present, else hf"""
    sampler_batch_size: int = 256
    """sequences decoded at once by the fallback sampler"""
    vllm_tp: int = 1
    """vLLM tensor parallelism: each engine is sharded over this many consecutive ranks"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take for weights and KV cache (on CPU: of the NUMA node's memory); the
    trainer needs the rest while vLLM is awake"""
    vllm_kv_cache_gib: float = 0.0
    """GiB of KV cache per vLLM engine instead of measuring free memory at its start (0: measure); set it when runs
    share a GPU (sanity/run_sanity.py --parallel): another process's allocations make that measurement fail"""
    vllm_sleep_level: Literal[0, 1, 2] = 1
    """vLLM sleep mode while the trainer trains (GPU only): 1 offloads the weights to CPU and frees the KV cache, 2
    also discards the weights (reloaded from the trainer before sampling), 0 keeps everything"""
    exact: bool = False
    """exact on-policy log-probs, old_logp equal to mu bit for bit (docs/exact.md: Qwen2, Qwen3, Llama; vLLM 0.25.1,
    --vllm-tp 1, a Hopper GPU, the same fp16 or bf16 on both sides); --compile has no effect then"""
    exact_check_every: int = 10
    """with --exact: the recompute forward (step 3) runs on a run's (or resume's) first step and every N steps after
    (1: every step); on the others old_logp is mu, and mismatch/* come from the first mini-batch's forward"""
    # --- memory and speed
    gradient_checkpointing: bool = True
    """recompute decoder layers' activations in the backward pass"""
    cpu_offload: bool = False
    """keep the trainer's fp32 weights, gradients and AdamW states in CPU memory (FSDP2 CPUOffloadPolicy) when they do
    not fit the GPUs: 16 bytes of pinned host memory per parameter, copies every forward and backward (docs/scale.md)"""
    compile: bool = True
    """torch.compile each decoder layer of the trainer on a GPU (the first step and change of shapes pay for it)"""
    logprob_chunk: int = 2048
    """tokens per chunk of the fp32 log-prob head (bounds its memory at chunk x vocab floats)"""
    # --- faults
    max_skipped_steps: int = 20
    """stop (saving the last good weights) after this many fp16 optimizer steps in a row skipped for non-finite
    gradients; in bf16/fp32 the first non-finite gradient stops the run (0: never stop for fp16 skips)"""
    kl_warn_factor: float = 10.0
    """warn (log line, mismatch/collapse_warning) when kl_k3 averaged over the last kl_baseline_steps steps exceeds
    this factor times its average over the first ones (0: off)"""
    kl_baseline_steps: int = 10
    """steps of the early kl_k3 baseline, and of the moving average compared with it"""
    # --- evaluation
    eval_dataset: tuple[str, ...] = ()
    """evaluation files (the training file's format), each logged as eval/<file name>/accuracy"""
    eval_every: int = 50
    """evaluate every N steps (and at the end); 0: only at the end"""
    eval_k: int = 4
    """responses per evaluation problem (avg@k)"""
    eval_temperature: float = 0.6
    """evaluation sampling temperature"""
    eval_top_p: float = 0.95
    """evaluation top-p"""
    eval_max_problems: int = 0
    """evaluate on at most this many problems of each file (0: all)"""
    # --- checkpoints
    save_every: int = 100
    """save a checkpoint every N steps (and at the end); 0: only at the end"""
    keep_last: int = 3
    """keep the newest N checkpoints (0: all)"""
    resume: str | None = None
    """resume from a checkpoint directory, or 'latest' for the newest one in <run_dir>/checkpoints"""
    overwrite: bool = False
    """start a new run in a --run-dir that holds another: its files are removed once this run's inputs are checked;
    without it (or --resume) such a directory is refused (docs/faults.md)"""
    accept_changes: bool = False
    """with --resume: continue where settings that define the run (model, data, seed, batch shape, precision, the
    algorithm's flags) differ from the checkpoint's, which is refused without it (docs/faults.md)"""


InfraField = tyro.conf.OmitArgPrefixes[Infra]  # an Args field's type: the flags stay --run-dir, not --infra.run-dir


def parse(args_class, preset: dict, argv: list[str] | None = None):
    """The command line over args_class's defaults, or without --model over the built-in task's (flat) `preset`."""
    args = tyro.cli(args_class, args=argv)
    if args.model is None:
        args = tyro.cli(args_class, args=argv, default=with_values(args_class(), preset))
    return args


def with_values(obj, values: dict):
    """A copy of the dataclass `obj` with `values` (flat field names) set, in nested groups too."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = with_values(value, values)
        elif f.name in values:
            changes[f.name] = values[f.name]
    return dataclasses.replace(obj, **changes)


# (valid(value), what is valid) of the flags scripts share; a script's own, or its own range for one, go to `ranges`
RANGES = {
    **{name: (lambda x: x >= 1, "at least 1") for name in (
        "num_steps", "num_prompts", "group_size", "num_minibatches", "micro_batch_tokens", "max_prompt_len",
        "max_response_len", "sampler_batch_size", "vllm_tp", "logprob_chunk", "kl_baseline_steps", "eval_k",
        "exact_check_every")},
    **{name: (lambda x: x >= 0, "at least 0") for name in (
        "seed", "max_skipped_steps", "eval_every", "eval_max_problems", "save_every", "keep_last")},
    **{name: (lambda x: math.isfinite(x) and x > 0, "finite and > 0") for name in ("temperature", "lr")},
    "adam_betas": (lambda b: all(0 <= x < 1 for x in b), "two numbers in [0, 1)"),
    "weight_decay": (lambda x: math.isfinite(x) and x >= 0, "finite and >= 0"),
    "max_grad_norm": (lambda x: x > 0, "> 0 (inf: no clipping)"),
    "eps_low": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "eps_high": (lambda x: math.isfinite(x) and x >= 0, "finite and >= 0"),
    "is_threshold": (lambda x: math.isfinite(x) and x > 0, "finite and > 0"),
    "truncated_reward": (math.isfinite, "finite"),
    "kl_warn_factor": (lambda x: math.isfinite(x) and x >= 0, "finite and >= 0 (0: off)"),
    "kl_coef": (lambda x: math.isfinite(x) and x >= 0, "finite and >= 0 (0: no KL term)"),
    "eval_temperature": (lambda x: math.isfinite(x) and x >= 0, "finite and >= 0 (0: greedy)"),
    "eval_top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "vllm_gpu_memory_utilization": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "vllm_kv_cache_gib": (lambda x: math.isfinite(x) and x >= 0, "finite and >= 0 (0: measured)"),
}


def check_ranges(args, ranges: dict) -> None:
    """ValueError naming the first field of `args` outside its range, {field name: (valid(value), what is valid)}."""
    values = flat_fields(args)
    for name, (valid, what) in ranges.items():
        if name in values and not valid(values[name]):
            raise ValueError(f"--{name.replace('_', '-')} {_show(values[name])}: must be {what}")


def exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def validate(args, world_size: int, **ranges) -> None:
    """The shared flags' checks, before any model loads (a script's own `ranges` go over RANGES)."""
    check_ranges(args, {**RANGES, **ranges})  # before the divisions below, which a 0 would break
    infra = args.infra
    exact_div(args.num_prompts, world_size, "--num-prompts over the ranks (world size)")
    if (args.num_prompts // world_size) % args.num_minibatches:  # (a mini-batch holds whole groups on every rank)
        raise ValueError(f"--num-prompts {args.num_prompts} over {world_size} rank{'s' * (world_size > 1)} leaves "
                         f"{args.num_prompts // world_size} a rank, which --num-minibatches {args.num_minibatches} "
                         f"does not divide: lower --num-minibatches or raise --num-prompts")
    if args.top_p != 1.0:
        raise ValueError("--top-p must be 1.0 for training rollouts: a truncated distribution makes mu and pi "
                         "incomparable (use --eval-top-p for evaluation)")
    exact_div(world_size, infra.vllm_tp, "the number of ranks over --vllm-tp")
    resolve_sampler(infra.sampler)
    if args.model is not None:
        check_model_dir(args.model)
    for path in ([args.dataset] if args.dataset else []) + list(infra.eval_dataset):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset {path!r}: no such file")
    if infra.run_dir == "":  # (not the default in disguise: a value given is a value used)
        raise ValueError("--run-dir '': an empty path; give a directory, or leave the flag out for the default, "
                         "runs/<exp_name>_<seed>")
    if infra.resume not in (None, "latest") and not os.path.isdir(infra.resume):
        raise FileNotFoundError(f"--resume {infra.resume!r}: no such directory")
    if infra.overwrite and infra.resume is not None:
        raise ValueError("--overwrite removes the run that --resume would continue: give one or the other")
    if infra.accept_changes and infra.resume is None:
        raise ValueError("--accept-changes accepts changed settings of a resumed run: it goes with --resume")
    if not infra.exact and infra.exact_check_every != Infra.exact_check_every:
        raise ValueError("--exact-check-every goes with --exact (without it the recompute runs every step)")


def steps(first: int, last: int):
    """first..last, each recorded as the step in progress while it runs (an interrupted run's message names it)."""
    for step in range(first, last + 1):
        exits.progress.step = step
        yield step


def recompute_due(infra, step: int, first_step: int) -> bool:
    """Whether step 3's recompute forward runs: always, but with --exact (old_logp is mu) per --exact-check-every."""
    return not infra.exact or step == first_step or step % infra.exact_check_every == 0


def run(main, parse_args) -> None:
    """A script's __main__: main(parse_args()) with its errors as exit codes and one line (common.exits.run)."""
    exits.run(lambda: main(parse_args()), sys.argv[0])

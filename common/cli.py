"""What every script shares on its command line: the infrastructure flags (Infra, one nested group of each script's
Args, flat on the command line), the range checks of every shared flag, the built-in task's preset, the start-up line
that says what a run uses, and the exit codes (docs/faults.md)."""
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
from common.rewards import check_reward, check_reward_flags
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
    """'vllm': an in-process vLLM engine per rank; 'hf': the fallback sampler on transformers (a plain copy of the
    policy); 'auto': vllm when it is installed and a GPU is present, else hf"""
    sampler_batch_size: int = 256
    """sequences decoded at once by the fallback sampler"""
    vllm_tp: int = 1
    """vLLM tensor parallelism: each engine is sharded over this many consecutive ranks"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take for weights and KV cache (on CPU: of the NUMA node's memory); the
    trainer needs the rest while vLLM is awake"""
    vllm_kv_cache_gib: float = 0.0
    """GiB of KV cache per vLLM engine, fixed instead of sized by measuring free memory while the engine starts (0:
    measure); set it when several runs share a GPU (sanity/run_sanity.py --parallel): another process allocating
    or freeing during that measurement makes the engine fail to start"""
    vllm_sleep_level: Literal[0, 1, 2] = 1
    """vLLM sleep mode while the trainer trains (GPU only): 1 offloads the weights to CPU and frees the KV cache, 2
    also discards the weights (reloaded from the trainer before sampling), 0 keeps everything"""
    exact: bool = False
    """exact on-policy log-probs (docs/exact.md): vLLM runs in its batch-invariant mode and the trainer's forward calls
    the same kernels op by op on unpadded sequences, so old_logp equals mu bit for bit (mismatch/unequal_tokens 0).
    Qwen2, Qwen3 and Llama models, vLLM 0.25.1, --vllm-tp 1, a Hopper GPU, the same fp16 or bf16 on both sides;
    --compile has no effect then"""
    exact_check_every: int = 10
    """with --exact: the recompute forward (step 3) runs on the first step of a run (or of a resume) and every N
    steps after, and its mismatch/unequal_tokens must be 0; on the other steps old_logp is mu, which is what the
    recompute would give bit for bit, and mismatch/*, train/entropy come from the first mini-batch's forward
    (1: every step)"""
    # --- memory and speed
    gradient_checkpointing: bool = True
    """recompute decoder layers' activations in the backward pass"""
    cpu_offload: bool = False
    """keep the trainer's sharded fp32 weights, gradients and AdamW states in CPU memory (FSDP2 CPUOffloadPolicy), for
    a model whose training state does not fit the GPUs: 16 bytes of pinned host memory per parameter and a copy of
    each layer's weights and gradients every forward and backward (docs/scale.md)"""
    compile: bool = True
    """torch.compile each decoder layer of the trainer on a GPU (fuses its many small kernels; the first step and the
    first change of shapes pay the compilation); no effect on a CPU"""
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
    """start a new run in a --run-dir that holds another one: remove that run's files (config.json, metrics.jsonl,
    checkpoints/), once this run's inputs are read and checked; without it (or --resume) such a directory is refused
    (docs/faults.md)"""
    accept_changes: bool = False
    """with --resume: continue even where settings that define the run (script, model, data, seed, batch shape,
    precision, the algorithm's flags) differ from those the checkpoint was trained with; without it such a resume is
    refused, naming the differences. Every change is said at start and recorded in config_resume_<step>.json
    (docs/faults.md)"""


InfraField = tyro.conf.OmitArgPrefixes[Infra]  # an Args field's type: the flags stay --run-dir, not --infra.run-dir


# ----------------------------------------------------------------------------------------------------------------
# the command line, and what a run uses


def parse(args_class, preset: dict, argv: list[str] | None = None):
    """The command line over args_class's defaults; when it names no --model, over the built-in task's `preset` (a
    flat dict of field names, nested groups' fields included)."""
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


# ----------------------------------------------------------------------------------------------------------------
# checks before any model loads


# (valid(value), what is valid) of every flag that more than one script has; a script's own flags, and another range
# for a shared one, go to check_ranges from its validate (an algorithm's rule too: --group-size at least 2 where the
# baseline is the group's mean is in the scripts that have that baseline)
RANGES = {
    **{name: (lambda x: x >= 1, "at least 1") for name in (
        "num_steps", "num_prompts", "group_size", "num_minibatches", "micro_batch_tokens", "max_prompt_len",
        "max_response_len", "sampler_batch_size", "vllm_tp", "logprob_chunk", "kl_baseline_steps", "eval_k",
        "exact_check_every")},
    **{name: (lambda x: x >= 0, "at least 0") for name in (
        "seed", "max_skipped_steps", "eval_every", "eval_max_problems", "save_every", "keep_last")},
    "temperature": (lambda x: math.isfinite(x) and x > 0, "finite and > 0"),
    "lr": (lambda x: math.isfinite(x) and x > 0, "finite and > 0"),
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
    """ValueError, one line naming the flag, for the first field of `args` (nested groups included) outside its
    range; ranges: {field name: (valid(value), what is valid)}, fields the script does not have are skipped."""
    values = flat_fields(args)
    for name, (valid, what) in ranges.items():
        if name in values and not valid(values[name]):
            raise ValueError(f"--{name.replace('_', '-')} {_show(values[name])}: must be {what}")


def exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def validate(args, world_size: int, **ranges) -> None:
    """The shared flags' checks, before any model loads: the RANGES (with a script's `ranges` over them), the batch
    shape over the ranks, the files, the reward, the sampler and the run directory's flags."""
    check_ranges(args, {**RANGES, **ranges})  # before the divisions below, which a 0 would break
    infra = args.infra
    exact_div(args.num_prompts, world_size, "--num-prompts over the ranks (world size)")
    exact_div(args.num_prompts // world_size, args.num_minibatches, "--num-prompts per rank over --num-minibatches")
    if args.top_p != 1.0:
        raise ValueError("--top-p must be 1.0 for training rollouts: a truncated distribution makes mu and pi "
                         "incomparable (use --eval-top-p for evaluation)")
    exact_div(world_size, infra.vllm_tp, "the number of ranks over --vllm-tp")
    resolve_sampler(infra.sampler)
    check_reward(args.reward)  # imports a plug-in's module here, so that a typo fails before any model loads
    check_reward_flags(args.learned_reward)  # no --rm-* flag without --reward-model (reward_model.py checks the rest)
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


# ----------------------------------------------------------------------------------------------------------------
# the steps, and how a script ends

def steps(first: int, last: int):
    """first..last, each recorded as the step in progress while it runs (an interrupted run's message names it)."""
    for step in range(first, last + 1):
        exits.progress.step = step
        yield step


def recompute_due(infra, step: int, first_step: int) -> bool:
    """Whether step 3's recompute forward runs at `step`: always, except with --exact, where the trainer's old_logp is
    the sampler's mu bit for bit, so the recompute runs only on the run's (or the resume's) first step and every
    --exact-check-every steps, to count the unequal tokens over the whole batch; on the other steps old_logp is mu,
    and the first mini-batch's forward, before any update, still counts them on its tokens."""
    return not infra.exact or step == first_step or step % infra.exact_check_every == 0


def run(main, parse_args) -> None:
    """A script's __main__: main(parse_args()) through common.exits.run: its errors as exit codes with one line
    (docs/faults.md): 2 bad input, 3 a training fault, 130 Ctrl-C (with the step and how to go on), a traceback for
    anything else; DEBUG=1 gives the traceback every time."""
    exits.run(lambda: main(parse_args()), sys.argv[0])

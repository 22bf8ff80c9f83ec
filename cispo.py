"""CISPO: a policy gradient whose importance weights are clipped and detached, so that no token loses its gradient.

What it is: CISPO (MiniMax-M1, "Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585,
Sec. 3.1): per token the loss -sg[clip(r_it, 1-eps_low, 1+eps_high)] A_i logp_it with r_it = exp(logp - old_logp),
summed over the mini-batch's response tokens and divided by their number (all ranks and micro-batches). PPO's clip
zeroes the gradient of a token whose ratio leaves the range (often the rare tokens that fork a line of reasoning);
CISPO only bounds its weight. No lower bound by default (the paper sets eps_low large: 1 - eps_low = 0), the upper
at 5 (the cap that TRL recommends for its loss_type="cispo", after ScaleRL, arXiv 2510.13786; the paper gives no
value). Advantages are GRPO's, normalized by the group's std (the paper's eq. 2; as gspo.py). No KL term, no entropy
bonus. The rollout corrections and --old-logp are grpo.py's (corrections.py, docs/corrections.md): their weight
multiplies each token's CISPO term. `diff grpo.py cispo.py` shows what CISPO changes; new lines are marked `# CISPO:`.

    python cispo.py                                  # the built-in task: a tiny model learns addition, no downloads
    python cispo.py --precision bf16                 # the same in BF16, to see the mismatch grow
    torchrun --nproc_per_node 8 cispo.py --model /path/to/DeepSeek-R1-Distill-Qwen-1.5B \\
        --dataset math_train.parquet --eval-dataset aime24.jsonl --precision fp16

One step: sample a rollout batch (prompts x G responses) -> rewards -> advantages -> recompute old_logp with the
trainer -> num_minibatches optimizer steps, each accumulating micro-batches sized by a token budget -> push the
new weights to the sampler -> log.
"""
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: threads that spin while waiting made
# CPU runs on 2 shared cores 3x slower (docs/results.md, "On a CPU")
import torch
import tyro
from transformers import AutoTokenizer

from common.batches import batch_problems, micro_batches
from common.checkpoint import (check_shared_dir, find_resume_dir, load_training_state, rng_state, save_checkpoint,
                               set_aside_newer, set_rng_state)
from common.config import config_changes, flat_fields
from common.data import encode_problems, load_problems
from common.dist import cleanup_distributed, phase_memory, print0, reduce_stats, seed_everything, setup_distributed
from common.evaluate import eval_name, evaluate
from common.fsdp import check_model_dir, iter_full_state, load_policy
from common.logger import Logger
from common.logprobs import collate, pad_float, recompute_logprobs, to_device
from common.metrics import (MismatchMonitor, first_minibatch_mismatch, mismatch_metrics, mismatch_stats,
                            add_sums, rollout_sums, step_metrics)
from common.precision import (DTYPES, LossScaler, TrainingFault, check_finite_logprobs, check_forward_range,
                              resolve_precisions)
from common.rewards import check_reward, check_step_rewards, score_rollout
from common.rundir import claim_run_dir, clear_run_dir
from common.sampler import make_sampler, resolve_sampler
from corrections import (Corrections, check_corrections, correction_metrics, correction_rules, correction_weights,
                         rejection_mask)
from tasks.builtin import with_builtin_task


@dataclass
class Args:
    """The study's defaults, for a real model (--model). Without --model the built-in task's preset BUILTIN (below)
    replaces some of them, under the command line; a run prints at start every value that differs from these."""
    # --- run
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the run (the run directory and wandb run are named after it)"""
    seed: int = 1
    """seed of the initial weights' randomness, the data order and (with the rank) the sampling streams"""
    run_dir: str | None = None
    """where metrics.jsonl, config.json and checkpoints/ go (default: runs/<exp_name>_<seed>)"""
    track: bool = False
    """log to Weights & Biases too (offline mode when no account is configured)"""
    wandb_project: str = "rl-mismatch"
    """the wandb project"""
    # --- model and data
    model: str | None = None
    """local Hugging Face model directory (default: the built-in task's tiny model, built on first use)"""
    dataset: str | None = None
    """training problems: .jsonl/.json/.parquet with problem (or prompt/question) and answer (or solution) fields"""
    eval_dataset: tuple[str, ...] = ()
    """evaluation files (same format), each logged as eval/<file name>/accuracy"""
    prompt_template: str = "chat"
    """'chat' (the tokenizer's chat template, with the R1-distill instruction), 'chat:<format>' (the chat template
    with <format> as the user turn, e.g. 'chat:{problem}') or a raw format string with {problem} and optionally
    {instruction}, e.g. '{problem}\\n{instruction}\\n'"""
    reward: str = "math"
    """'math': math-verify on the last \\boxed{}; 'exact': the stripped response equals the answer; 'number': its
    final number (after '####', else after 'the answer is', else the last) equals the answer's; 'module:function':
    your fn(response, answer) -> float, e.g. my_rewards:score, run in a time-limited worker (README, Rewards)"""
    max_prompt_len: int = 1024
    """prompts longer than this (tokens) are reported and skipped, never cut"""
    max_response_len: int = 8192
    """response length limit in tokens"""  # CISPO: its normalizer is the token count, not L_max
    truncated_reward: float = 0.0
    """reward of a response cut at the length limit (no end-of-sequence token)"""
    # --- sampling
    sampler: Literal["auto", "vllm", "hf"] = "auto"
    """'vllm': an in-process vLLM engine per rank; 'hf': the fallback sampler on transformers (a plain copy of the
    policy); 'auto': vllm when it is installed and a GPU is present, else hf"""
    temperature: float = 1.0
    """sampling temperature of training rollouts; the trainer divides its logits by it too"""
    top_p: float = 1.0
    """must stay 1.0 for training rollouts: a truncated distribution makes mu and pi incomparable"""
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
    # --- precision
    precision: Literal["fp16", "bf16", "fp32"] = "fp16"
    """precision of both the trainer's compute and the sampler's weights"""
    train_precision: Literal["fp16", "bf16", "fp32"] | None = None
    """override --precision for the trainer (FSDP2 param_dtype; master weights and Adam states are fp32)"""
    rollout_precision: Literal["fp16", "bf16", "fp32"] | None = None
    """override --precision for the sampler's weights"""
    # --- algorithm
    num_steps: int = 500
    """RL steps (rollout batches)"""
    num_prompts: int = 64
    """prompts per rollout batch, over all ranks"""
    group_size: int = 8
    """responses per prompt (G)"""
    num_minibatches: int = 4
    """optimizer steps per rollout batch (each over num_prompts / num_minibatches prompts' groups)"""
    micro_batch_tokens: int = 32768
    """token budget of a micro-batch (rows x longest row, padding included); gradients accumulate over them"""
    lr: float = 1e-6
    """AdamW learning rate (constant)"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    eps_low: float = 1.0  # CISPO: no lower bound (arXiv 2506.13585 Sec. 3.1)
    """CISPO: lower bound 1 - eps_low on the importance weight r_it (1: none)"""
    eps_high: float = 4.0  # CISPO: a weight of at most 5 (TRL's recommendation for loss_type="cispo")
    """CISPO: upper bound 1 + eps_high on the importance weight r_it"""
    is_threshold: float = 3.0
    """C of the corrections (the study's text: 3; its code used 2 for Token-TIS and 10 for Seq-MIS; verl: 2)"""
    corrections: tyro.conf.OmitArgPrefixes[Corrections] = dataclasses.field(default_factory=Corrections)
    """the rollout corrections: --is-correction, --is-reject, --is-veto and their bounds (corrections.py)"""
    old_logp: Literal["recompute", "mu"] = "recompute"
    """pi_old of the PPO ratio: 'recompute' (a forward of the trainer over the batch before training) or 'mu' (the
    sampler's log-probs, verl's bypass mode: no recompute, the ratio is pi_theta/mu, --is-correction is refused,
    the rejection rules read pi_theta/mu, and mismatch/*, train/entropy come from the first mini-batch's forward)"""
    # --- memory
    gradient_checkpointing: bool = True
    """recompute decoder layers' activations in the backward pass"""
    cpu_offload: bool = False
    """keep the trainer's sharded fp32 weights, gradients and AdamW states in CPU memory (FSDP2 CPUOffloadPolicy), for
    a model whose training state does not fit the GPUs. Costs 16 bytes of pinned host memory per parameter (over all
    ranks) and time: every forward and backward copies each layer's weights to the GPU and its gradients back, and
    AdamW runs on the CPU"""
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
    # --- evaluation and checkpoints
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
    save_every: int = 100
    """save a checkpoint every N steps (and at the end); 0: only at the end"""
    keep_last: int = 3
    """keep the newest N checkpoints (0: all)"""
    resume: str | None = None
    """resume from a checkpoint directory, or 'latest' for the newest one in <run_dir>/checkpoints"""
    overwrite: bool = False
    """start a new run in a --run-dir that holds another one: remove that run's files first (config.json,
    metrics.jsonl, checkpoints/); without it (or --resume) such a directory is refused (docs/faults.md)"""


# The built-in task's defaults (a 0.4M-parameter model learning addition on a CPU in a minute or two). Evaluation
# samples as training does (temperature 1), so that eval accuracy shows what training changed.
BUILTIN = dict(num_steps=100, num_prompts=64, group_size=8, num_minibatches=2, micro_batch_tokens=4096, lr=5e-4,
               max_prompt_len=16, max_response_len=8, prompt_template="{problem}", reward="exact",
               eval_every=20, eval_k=4, eval_temperature=1.0, eval_top_p=1.0, save_every=50, precision="fp32",
               gradient_checkpointing=False, sampler_batch_size=1024)


# ----------------------------------------------------------------------------------------------------------------
# The algorithm: pure functions, importable without side effects.

def std_advantages(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO with std (CISPO, arXiv 2506.13585 eq. 2): A_i = (r_i - mean) / (std + 1e-6) over its group, std being
    torch.std's default, the unbiased estimate (divides by G - 1). rewards_B holds whole groups in order."""
    r_GN = rewards_B.view(-1, group_size)
    return ((r_GN - r_GN.mean(-1, keepdim=True)) / (r_GN.std(-1, keepdim=True) + 1e-6)).view(-1)


def policy_loss(logp_BT, old_logp_BT, adv_B, weight_BT, mask_BT, eps_low: float, eps_high: float, num_tokens: float):
    """CISPO's objective (arXiv 2506.13585 eq. 4-5), as a loss with its token-count normalizer:
    loss = -(1/N_tok) sum_i sum_t m_it w_it sg[clip(r_it, 1-eps_low, 1+eps_high)] A_i logp_it, r_it = exp(logp - old_logp),
    w_it the rollout correction's weight. N_tok is the mini-batch's response-token count over all ranks and
    micro-batches, so summing this over micro-batches (and averaging gradients over ranks, each rank's loss times world
    size) gives the same value whatever the split. Every token keeps a gradient, -w r_clipped A / N_tok on its logp.
    Returns (loss, local sums for the clip fraction (tokens whose weight was clipped: unlike PPO's, their gradient
    stays) and approx KL, as 0-d tensors: the caller adds them up and reads them once per step)."""
    m = mask_BT.float()
    log_ratio_BT = logp_BT - old_logp_BT
    ratio_BT = torch.exp(log_ratio_BT.detach())
    w_clip_BT = ratio_BT.clamp(1 - eps_low, 1 + eps_high)  # sg[clip(r)]: a constant
    loss_BT = -(w_clip_BT * adv_B[:, None]) * logp_BT * weight_BT
    loss = (loss_BT * m).sum() / num_tokens
    with torch.no_grad():
        clipped = (ratio_BT > 1 + eps_high) | (ratio_BT < 1 - eps_low)
        stats = {"clip": (clipped.float() * m).sum(),
                 "approx_kl": ((torch.expm1(log_ratio_BT) - log_ratio_BT) * m).sum(),  # k3 of KL(old||theta)
                 "tokens": m.sum()}
    return loss, stats


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over Args' defaults; when it names no --model, over the built-in task's preset BUILTIN."""
    args = tyro.cli(Args, args=argv)
    if args.model is None:
        args = tyro.cli(Args, args=argv, default=dataclasses.replace(Args(), **BUILTIN))
    return args


def validate(args: Args, world_size: int) -> None:
    """Everything that can be checked before a model is loaded."""
    def exact(a, b, what):
        if a % b:
            raise ValueError(f"{what}: {a} is not divisible by {b}")
        return a // b
    finite = math.isfinite
    ranges = [  # (field, valid(value), what is valid); checked before the divisions below, which a 0 would break
        *[(name, lambda x: x >= 1, "at least 1") for name in (
            "num_steps", "num_prompts", "num_minibatches", "micro_batch_tokens", "max_prompt_len", "max_response_len",
            "sampler_batch_size", "vllm_tp", "logprob_chunk", "kl_baseline_steps", "eval_k")],
        *[(name, lambda x: x >= 0, "at least 0") for name in (
            "seed", "max_skipped_steps", "eval_every", "eval_max_problems", "save_every", "keep_last")],
        ("group_size", lambda x: x >= 2, "at least 2: the advantages' baseline is the group's mean reward, so a "
         "group of one has no learning signal"),
        ("temperature", lambda x: finite(x) and x > 0, "finite and > 0"),
        ("lr", lambda x: finite(x) and x > 0, "finite and > 0"),
        ("adam_betas", lambda b: all(0 <= x < 1 for x in b), "two numbers in [0, 1)"),
        ("weight_decay", lambda x: finite(x) and x >= 0, "finite and >= 0"),
        ("max_grad_norm", lambda x: x > 0, "> 0 (inf: no clipping)"),
        ("eps_low", lambda x: 0 <= x <= 1, "in [0, 1] (1: no lower bound)"),  # CISPO: 1 allowed
        ("eps_high", lambda x: finite(x) and x >= 0, "finite and >= 0"),
        ("is_threshold", lambda x: finite(x) and x > 0, "finite and > 0"),
        ("truncated_reward", finite, "finite"),
        ("kl_warn_factor", lambda x: finite(x) and x >= 0, "finite and >= 0 (0: off)"),
        ("eval_temperature", lambda x: finite(x) and x >= 0, "finite and >= 0 (0: greedy)"),
        ("eval_top_p", lambda x: 0 < x <= 1, "in (0, 1]"),
        ("vllm_gpu_memory_utilization", lambda x: 0 < x <= 1, "in (0, 1]"),
        ("vllm_kv_cache_gib", lambda x: finite(x) and x >= 0, "finite and >= 0 (0: measured)"),
    ]
    for name, valid, what in ranges:
        if not valid(getattr(args, name)):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be {what}")
    exact(args.num_prompts, world_size, "--num-prompts over the ranks (world size)")
    exact(args.num_prompts // world_size, args.num_minibatches, "--num-prompts per rank over --num-minibatches")
    if args.top_p != 1.0:
        raise ValueError("--top-p must be 1.0 for training rollouts: a truncated distribution makes mu and pi "
                         "incomparable (use --eval-top-p for evaluation)")
    exact(world_size, args.vllm_tp, "the number of ranks over --vllm-tp")
    resolve_sampler(args.sampler)
    check_reward(args.reward)  # imports a plug-in's module here, so that a typo fails before any model loads
    if args.model is not None:
        check_model_dir(args.model)
    for path in ([args.dataset] if args.dataset else []) + list(args.eval_dataset):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset {path!r}: no such file")
    if args.resume not in (None, "latest") and not os.path.isdir(args.resume):
        raise FileNotFoundError(f"--resume {args.resume!r}: no such directory")
    if args.overwrite and args.resume is not None:
        raise ValueError("--overwrite removes the run that --resume would continue: give one or the other")
    check_corrections(args.corrections, args.is_threshold, args.old_logp)


current_step = 0  # the step in progress, which __main__'s message on Ctrl-C names


def main(args: Args) -> None:
    global current_step
    rank, world_size, device = setup_distributed(cpu_offload=args.cpu_offload)  # gloo only for offload
    print0(config_changes(args, Args(), BUILTIN if args.model is None else {},
                          f"BUILTIN in {os.path.basename(__file__)} (no --model)"))
    validate(args, world_size)
    rules = correction_rules(args.corrections)
    seq_ratio = args.corrections.is_correction in ("seq-tis", "seq-mis")  # is/ratio_* over the sequence ratios rho
    recompute = args.old_logp == "recompute"  # else pi_old is mu (--old-logp mu): no recompute forward
    train_prec, rollout_prec = resolve_precisions(args.precision, args.train_precision, args.rollout_precision)
    seed_everything(args.seed)
    run_dir = args.run_dir or os.path.join("runs", f"{args.exp_name}_{args.seed}")
    ckpt_root = os.path.join(run_dir, "checkpoints")
    # one run per directory, one at a time: rank 0 holds the directory's lock until this process ends
    run_lock = claim_run_dir(run_dir, args.resume is not None, args.overwrite)  # noqa: F841
    check_shared_dir(run_dir, device)  # every rank writes its shards into the checkpoints: fail now, not at a save

    # --- data
    model_path, dataset, eval_paths = with_builtin_task(args.model, args.dataset, list(args.eval_dataset))
    resume_dir = find_resume_dir(args.resume, ckpt_root) if args.resume else None
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    problems = encode_problems(tokenizer, load_problems(dataset), args.prompt_template, args.max_prompt_len, dataset)
    eval_sets = {}
    for path in eval_paths:
        ps = encode_problems(tokenizer, load_problems(path), args.prompt_template, args.max_prompt_len, path)
        eval_sets[eval_name(path)] = ps[:args.eval_max_problems] if args.eval_max_problems else ps
    print0(f"[data] {len(problems)} training problems; eval: {', '.join(f'{k} ({len(v)})' for k, v in eval_sets.items()) or 'none'}")

    # --- models: the trainer (FSDP2, fp32 master weights) and the sampler (its own copy, rollout precision)
    weights_path = resume_dir or model_path
    model = load_policy(weights_path, DTYPES[train_prec], device, args.gradient_checkpointing,
                        cpu_offload=args.cpu_offload, compile=args.compile)
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=args.adam_betas, weight_decay=args.weight_decay)
    scaler = LossScaler(enabled=train_prec == "fp16", max_consecutive_skips=args.max_skipped_steps)
    monitor = MismatchMonitor(args.kl_warn_factor, args.kl_baseline_steps)  # early warning of collapse
    sampler_kind, why = resolve_sampler(args.sampler)
    print0(f"[sampler] {sampler_kind} ({why})")
    sampler = make_sampler(sampler_kind, weights_path, rollout_prec, device, args.seed, rank,
                           args.max_prompt_len + args.max_response_len, args.sampler_batch_size, args.vllm_tp,
                           args.vllm_gpu_memory_utilization, args.vllm_sleep_level, args.vllm_kv_cache_gib)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    print0(f"[setup] {world_size} rank(s) on {device.type}; train {train_prec}, rollout {rollout_prec}; "
           f"{sum(p.numel() for p in params) / 1e6:.1f}M parameters")  # a DTensor's numel is the full size

    start_step = 0
    if resume_dir:
        trainer_state, rank_state = load_training_state(resume_dir, model, optimizer)
        start_step = trainer_state["step"]
        scaler.load_state_dict(trainer_state["scaler"])
        monitor.load_state_dict(trainer_state["kl_monitor"])
        if rank_state:
            set_rng_state(rank_state, getattr(sampler, "generator", None))
        print0(f"[resume] from {resume_dir} at step {start_step}")
        set_aside_newer(ckpt_root, start_step)  # from an older step: the later checkpoints are moved aside

    if args.overwrite:  # only now, with the inputs read and checked (docs/faults.md)
        clear_run_dir(run_dir)
    logger = Logger(run_dir, flat_fields(args), enabled=rank == 0, total_steps=args.num_steps,
                    start_step=start_step, track=args.track, project=args.wandb_project, run_name=args.exp_name)
    def run_eval(step: int) -> None:
        if eval_sets:
            sampler.wake_up()
            metrics = evaluate(sampler, tokenizer, eval_sets, args.eval_k, args.eval_temperature, args.eval_top_p,
                               args.max_response_len, args.reward, rank, world_size, device)
            sampler.sleep()
            logger.log(metrics, step, advance=False)

    def save(step: int) -> None:
        save_checkpoint(ckpt_root, step, model, model.lm, tokenizer, optimizer,
                        {"scaler": scaler.state_dict(), "kl_monitor": monitor.state_dict()},
                        rng_state(getattr(sampler, "generator", None)), args.keep_last)

    # before any step: do the forward's activations fit the train and rollout precisions? (a clear error now, rather
    # than steps skipped for fp16 overflows or rollouts sampled from NaN)
    check_forward_range(model, model.lm, [p["prompt_ids"] for p in batch_problems(problems, start_step, args.num_prompts, rank,
                                                                           world_size, args.seed)], pad_id, device,
                        train_prec, rollout_prec, args.logprob_chunk)
    step = start_step
    if start_step == 0 and args.eval_every:
        run_eval(0)  # the starting point
    for step in range(start_step + 1, args.num_steps + 1):
        current_step = step
        t_step = time.perf_counter()
        mem = phase_memory(device)  # {}; resets the peak; each phase adds its GPU memory (none on CPU)
        # --- 1. sample G responses per prompt with the sampler (weights = the current policy, rollout precision)
        t0 = time.perf_counter()
        sampler.wake_up()
        batch = batch_problems(problems, step - 1, args.num_prompts, rank, world_size, args.seed)
        rollout = sampler.generate([p["prompt_ids"] for p in batch], args.group_size, args.max_response_len,
                                   args.temperature, 1.0)
        mem.update(phase_memory(device, "sample"))  # while the sampler is awake
        sampler.sleep()
        t_sample = time.perf_counter() - t0

        # --- 2. rewards and std-normalized advantages (CISPO, arXiv 2506.13585 eq. 2; groups are whole on each rank)
        texts = tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        answers = [p["answer"] for p in batch for _ in range(args.group_size)]
        rewards, reward_failures = score_rollout(texts, answers, rollout.finished, args.reward, args.truncated_reward,
                                                 progress=rank == 0)
        check_step_rewards(step, reward_failures, sum(rollout.finished), device)  # stops if all failed
        rewards_B = torch.tensor(rewards)
        adv_B = std_advantages(rewards_B, args.group_size)  # CISPO
        resp_lens = [len(r) for r in rollout.response_ids]
        seq_lens = [len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]

        # --- 3. recompute old_logp with the trainer (the weights that sampled the batch), and the entropy
        t0 = time.perf_counter()
        groups = micro_batches(seq_lens, args.micro_batch_tokens, device) if recompute else []
        old_logp, entropy_sum = recompute_logprobs(model, rollout.prompt_ids, rollout.response_ids, groups, pad_id,
                                                   args.temperature, args.logprob_chunk, device)
        t_recompute = time.perf_counter() - t0
        mem.update(phase_memory(device, "recompute"))

        # --- 4. mismatch metrics: the sampler's mu_logp against the trainer's old_logp, every response token
        T = max(1, max(resp_lens))
        rmask_all = torch.arange(T)[None] < torch.tensor(resp_lens)[:, None]
        mu_all = pad_float(rollout.logprobs, T, "cpu")
        old_all = pad_float(old_logp, T, "cpu") if recompute else mu_all
        check_finite_logprobs(step, rmask_all, device, train_prec, rollout_prec, old_logp=old_all, mu_logp=mu_all)
        sums, maxes, mins = mismatch_stats(old_all, mu_all, rmask_all, args.is_threshold, seq_ratio)
        r_sums, r_maxes = rollout_sums(rewards_B, args.group_size, reward_failures, rollout.finished, resp_lens,
                                       seq_lens, entropy_sum)
        sums.update(r_sums)
        maxes.update(r_maxes)
        w_all, w_sums, w_maxes = correction_weights(old_all, mu_all, rmask_all, args.corrections, args.is_threshold)
        sums.update(w_sums)
        maxes.update(w_maxes)

        # --- 5. num_minibatches optimizer steps over the rollout batch (whole groups per mini-batch)
        t0 = time.perf_counter()
        model.train()
        seqs_per_mb = len(seq_lens) // args.num_minibatches
        # CISPO: N_tok of the normalizer, each mini-batch's response tokens over all ranks (one all-reduce)
        num_tokens_global = reduce_stats({k: sum(resp_lens[k * seqs_per_mb:(k + 1) * seqs_per_mb])
                                          for k in range(args.num_minibatches)}, "sum", device)
        loss_sum, pol = 0.0, {}  # summed over micro-batches: the loss's statistics
        first_logp, first_entropy = {}, 0.0  # pi_old's rows and entropy when nothing recomputes them
        grad_norms, skipped = [], 0
        for k in range(args.num_minibatches):
            mb_idx = list(range(k * seqs_per_mb, (k + 1) * seqs_per_mb))
            for micro in micro_batches([seq_lens[i] for i in mb_idx], args.micro_batch_tokens, device):
                idx = [mb_idx[j] for j in micro]
                ids, attn, rmask = collate([rollout.prompt_ids[i] for i in idx],
                                           [rollout.response_ids[i] for i in idx], pad_id, device)
                Tm = rmask.shape[1]
                first = k == 0 and not recompute  # before any update: these are pi_old's log-probs
                logp_BT, ent_BT = model(ids, attn, rmask, args.temperature, args.logprob_chunk, with_entropy=first)
                if first:
                    first_entropy += ent_BT.detach()[rmask].sum()
                    first_logp.update((i, row[:resp_lens[i]]) for i, row in zip(idx, logp_BT.detach().cpu()))
                old_BT, mu_BT = to_device(old_all[idx, :Tm], device), to_device(mu_all[idx, :Tm], device)
                adv_mb = to_device(adv_B[idx], device)
                # the rejection rules on pi_old/mu, or with --old-logp mu on pi_theta/mu (verl's bypass mode)
                keep_BT, rej_mb = rejection_mask(old_BT if recompute else logp_BT.detach(),
                                                 logp_BT.detach(), mu_BT, adv_mb, rmask, rules)
                weight_BT = torch.where(keep_BT, to_device(w_all[idx, :Tm], device), 0.0)
                loss, stats = policy_loss(logp_BT, old_BT, adv_mb, weight_BT, rmask, args.eps_low, args.eps_high,
                                          max(num_tokens_global[k], 1.0))  # CISPO
                # FSDP averages gradients over ranks; times world_size makes that the global sum / N_tok
                scaler.scale_loss(loss * world_size).backward()
                loss_sum += loss.detach()
                add_sums(pol, stats)
                add_sums(sums, rej_mb)  # the rejection counts, summed into the step's statistics
            norm, was_skipped = scaler.step(params, optimizer, args.max_grad_norm)
            grad_norms.append(norm)
            skipped += was_skipped
            if scaler.fault:
                break  # no more updates from this batch; the run stops after logging it
        t_train = time.perf_counter() - t0
        mem.update(phase_memory(device, "train"))

        # --- 6. push the new weights to the sampler
        t0 = time.perf_counter()
        sampler.load_weights(iter_full_state(model.lm, DTYPES[rollout_prec], device))
        t_sync = time.perf_counter() - t0
        mem.update(phase_memory(device, "sync"))

        # --- 7. log
        sums.update(loss=loss_sum, **{f"policy_{key}": v for key, v in pol.items()})
        g, g_max, g_min = (reduce_stats(d, op, device) for d, op in ((sums, "sum"), (maxes, "max"), (mins, "min")))
        metrics = {
            **step_metrics(g, g_max, args.group_size, args.num_minibatches, grad_norms, scaler, args.lr,
                           {"sample": t_sample, "recompute": t_recompute, "train": t_train, "sync": t_sync}), **mem,
            **mismatch_metrics(g, g_max, g_min, seq_ratio),
            **correction_metrics(g, g_max, rules),
            "policy/clip_frac": g["policy_clip"] / max(g["policy_tokens"], 1.0),  # CISPO: tokens whose weight was clipped
            "policy/approx_kl": g["policy_approx_kl"] / max(g["policy_tokens"], 1.0),
        }
        if not recompute:  # no recompute: the mismatch against the first mini-batch's forward instead
            metrics.update(first_minibatch_mismatch(first_logp, mu_all, rmask_all, float(first_entropy),
                                                    args.is_threshold, seq_ratio, device))
        kl_metrics, warning = monitor.update(metrics["mismatch/kl_k3"])
        metrics.update(kl_metrics)
        metrics["time/step"] = time.perf_counter() - t_step
        logger.log(metrics, step)
        if warning:
            print0(warning)
        if scaler.fault:  # a skipped step left the weights untouched: they are the last good state; keep it and stop
            save(step)
            raise TrainingFault(f"step {step}: {scaler.fault}; the last good state is saved in {ckpt_root}")

        if args.eval_every and step % args.eval_every == 0 and step < args.num_steps:
            run_eval(step)
        if args.save_every and step % args.save_every == 0 and step < args.num_steps:
            save(step)

    if step > start_step:  # before the final evaluation, whose sampling would advance the saved sampler stream
        save(step)
    run_eval(step)
    logger.close()
    sampler.shutdown()  # (vLLM's engine needs the process group for its own clean-up)


if __name__ == "__main__":
    try:
        main(parse_args())
    except (ValueError, FileNotFoundError, PermissionError, TrainingFault) as e:  # one line, no traceback
        if os.environ.get("DEBUG"):
            raise
        print(f"{os.path.basename(__file__)}: error: {e}", file=sys.stderr)
        sys.exit(3 if isinstance(e, TrainingFault) else 2)  # 3: stopped by a fault, 2: bad input
    except KeyboardInterrupt:  # Ctrl-C: where the run stopped and how to go on, not a traceback
        if os.environ.get("DEBUG"):
            raise
        print(f"{os.path.basename(__file__)}: interrupted at step {current_step}; resume with --resume latest",
              file=sys.stderr)
        sys.exit(130)  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended
    cleanup_distributed()  # after main() returned: its model holds the process group, which must be freed here

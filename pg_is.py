"""PG-Seq-IS: plain policy gradient with a sequence-level importance weight pi_theta/mu (also -TIS, -MIS).

What it computes, each formula's source and the defaults: docs/algorithms.md, this script's section.

    python pg_is.py                                   # the built-in task: a tiny model learns addition, no downloads
    torchrun --nproc_per_node 8 pg_is.py --model /path/to/DeepSeek-R1-Distill-Qwen-1.5B \\
        --dataset math_train.parquet --eval-dataset aime24.jsonl --precision fp16

With --precision bf16 the training-inference mismatch grows (docs/results.md).

One step: sample a rollout batch (prompts x G responses) -> rewards -> advantages -> recompute old_logp with the
trainer -> num_minibatches optimizer steps, each accumulating micro-batches sized by a token budget -> push the
new weights to the sampler -> log.
"""
import dataclasses
import math
import os
from dataclasses import dataclass
from importlib import import_module
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: threads that spin while waiting made
# CPU runs on 2 shared cores 3x slower (docs/results.md, "On a CPU")
import torch

from common import batches, cli, logprobs, metrics, preflight, rundir
from common.dist import print0, seed_everything, setup_distributed
from common.fsdp import iter_full_state, load_policy, load_reference
from common.logger import Logger
from common.precision import LossScaler, TrainingFault, check_finite_logprobs, resolve_precisions
from common.sampler import make_sampler
from corrections import LOG_RATIO_MAX, importance_weights, measure  # PG-Seq-IS: w_i, and pi_old/mu's metrics
from tasks import data, rewards
from tasks.builtin import with_builtin_task


@dataclass
class Args:
    """The study's defaults, for a real model (--model). Without --model the built-in task's preset BUILTIN (below)
    replaces some of them, under the command line; a run prints at start every value that differs from these."""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the run (the run directory and wandb run are named after it)"""
    seed: int = 1
    """seed of the initial weights' randomness, the data order and (with the rank) the sampling streams"""
    # --- model and data
    model: str | None = None
    """local Hugging Face model directory (default: the built-in task's tiny model, built on first use)"""
    dataset: str | None = None
    """training problems: .jsonl/.json/.parquet with problem (or prompt/question) and answer (or solution) fields"""
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
    """response length limit in tokens, and L_max of Dr.GRPO's constant normalizer"""
    truncated_reward: float = 0.0
    """reward of a response cut at the length limit (no end-of-sequence token)"""
    learned_reward: rewards.RewardModelField = dataclasses.field(default_factory=rewards.RewardModelFlags)
    """a reward model's score as the reward that trains: --reward-model and its --rm-* flags (docs/reward-models.md)"""
    temperature: float = 1.0
    """sampling temperature of training rollouts; the trainer divides its logits by it too"""
    top_p: float = 1.0
    """must stay 1.0 for training rollouts: a truncated distribution makes mu and pi incomparable"""
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
    kl_coef: float = 0.0
    """beta of a KL penalty to the reference policy, the run's starting weights (frozen): beta * k3 per token in the
    loss, under the loss's normalizer (verl's use_kl_loss with low_var_kl); 0: none, and no reference is loaded"""
    is_mode: Literal["is", "tis", "mis"] = "is"  # PG-Seq-IS: in place of the PPO clip and --is-correction
    """the sequence weight, rho = prod_t pi_theta/mu: 'is' rho, 'tis' min(rho, C), 'mis' rho * 1{rho <= C}"""
    is_threshold: float = 3.0  # PG-Seq-IS
    """C of --is-mode tis / mis and of the is/ diagnostics"""
    mismatch_from: Literal["recompute", "first-minibatch"] = "recompute"  # PG-Seq-IS
    """pi_old of the metrics only: 'recompute' (a forward before training) or 'first-minibatch' (no extra forward)"""
    infra: cli.InfraField = dataclasses.field(default_factory=cli.Infra)
    """how the run is carried out: run directory, sampler, memory, faults, evaluation, checkpoints (common/cli.py)"""


# The built-in task's defaults (a 0.4M-parameter model learning addition on a CPU in a minute or two). Evaluation
# samples as training does (temperature 1), so that eval accuracy shows what training changed.
BUILTIN = dict(num_steps=100, num_prompts=64, group_size=8, num_minibatches=2, micro_batch_tokens=4096, lr=5e-4,
               max_prompt_len=16, max_response_len=8, prompt_template="{problem}", reward="exact",
               eval_every=20, eval_k=4, eval_temperature=1.0, eval_top_p=1.0, save_every=50, precision="fp32",
               gradient_checkpointing=False, sampler_batch_size=1024)


# ----------------------------------------------------------------------------------------------------------------
# The algorithm: pure functions, importable without side effects.

def drgrpo_advantages(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO: A_i = r_i - mean of its group (no division by the std). rewards_B holds whole groups in order."""
    r_GN = rewards_B.view(-1, group_size)
    return (r_GN - r_GN.mean(-1, keepdim=True)).view(-1)


def kl_k3(logp_BT, ref_logp_BT):
    """KL: k3 = exp(d) - d - 1, d = ref_logp - logp, per token: KL(pi_theta || pi_ref) with verl's low_var_kl clamps
    (docs/reward-models.md, "A leash on the policy")."""
    d_BT = (ref_logp_BT - logp_BT).clamp(-20.0, 20.0)
    return (torch.exp(d_BT) - d_BT - 1).clamp(max=10.0)


def policy_loss(logp_BT, old_logp_BT, mu_logp_BT, adv_B, mask_BT, is_mode: str, threshold: float,
                max_response_len: int, num_seqs: int, ref_logp_BT=None, kl_coef: float = 0.0):
    """PG-Seq-IS with Dr.GRPO's constant normalizer (docs/algorithms.md):
    loss = (1/N_seq) sum_i sum_t m_it (w_it l_it + beta k3_it) / L_max, w_it the rollout correction's weight,
    l_it = -A_i logp_it, w_it = sg[w_i] (--is-mode); old_logp only for policy/approx_kl (None: none); and max rho.
    The normalizer counts all ranks and micro-batches, so the sum over micro-batches (each rank's loss times world
    size) is the same whatever the split.
    Returns (loss, {metric: (total, count)}), 0-d tensors that the step adds up (a .item() would wait for the GPU)."""
    m = mask_BT.float()
    log_rho_B = ((logp_BT.detach() - mu_logp_BT) * m).sum(-1)  # PG-Seq-IS: rho_i = pi_theta/mu over the sequence
    w_BT, _ = importance_weights(logp_BT.detach(), mu_logp_BT, m, "seq-mis" if is_mode == "mis" else "seq-tis",
                                 math.exp(LOG_RATIO_MAX) if is_mode == "is" else threshold)  # is: seq-tis at C = e^20
    loss_BT = -(w_BT * adv_B[:, None]) * logp_BT
    if ref_logp_BT is not None:  # KL: beta * k3 per token, under the loss's normalizer (verl: use_kl_loss)
        loss_BT = loss_BT + kl_coef * kl_k3(logp_BT, ref_logp_BT)
    loss = (loss_BT * m).sum() / max_response_len / num_seqs
    with torch.no_grad():
        rho_B = torch.exp(log_rho_B.clamp(max=LOG_RATIO_MAX))  # capped as --is-mode is caps it (an inf: a useless mean)
        n = len(w_BT)
        stats = {"is/ratio_mean": (rho_B.sum(), n), "is/weight_mean": (w_BT[:, 0].sum(), n),
                 "is/seq_mask_frac": ((log_rho_B > math.log(threshold)).sum(), n),
                 "is/log_rho_clamp_frac": ((log_rho_B > LOG_RATIO_MAX).sum(), n)}
        if old_logp_BT is not None:
            log_ratio_BT = logp_BT.detach() - old_logp_BT
            stats["policy/approx_kl"] = (((torch.expm1(log_ratio_BT) - log_ratio_BT) * m).sum(), m.sum())  # k3
    return loss, stats, rho_B.max()


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over Args' defaults; when it names no --model, over the built-in task's preset BUILTIN."""
    return cli.parse(Args, BUILTIN, argv)


# (a fork whose baseline is not the group's mean, as ppo.py's critic, drops this rule)
GROUP_SIZE = (lambda x: x >= 2, "at least 2: the advantages' baseline is the group's mean reward, so a group of one "
              "has no learning signal")
TOKEN_CLIP = ("is/token_clip_frac",)  # PG-Seq-IS: the one is/ key of pi_old/mu; the others are of the loss's rho


def validate(args: Args, world_size: int) -> None:
    """Everything that can be checked before a model is loaded: the flags every script shares (common/cli.py), then
    this script's."""
    cli.validate(args, world_size, group_size=GROUP_SIZE)
    rewards.check_args(args)  # --reward (a plug-in's module imported, in a worker) and the --rm-* flags


def main(args: Args) -> None:
    infra = args.infra  # the flags of how the run is carried out (common/cli.py)
    rank, world_size, device = setup_distributed(cpu_offload=infra.cpu_offload)  # gloo only for offload
    print0(cli.config_changes(args, Args(), BUILTIN if args.model is None else {},
                              f"BUILTIN in {os.path.basename(__file__)} (no --model)"))
    validate(args, world_size)
    # the optional features, imported only when a flag asks for them, and refused here, before any model loads, where
    # they cannot run: exact.py (--exact, docs/exact.md), reward_model.py (--reward-model, docs/reward-models.md)
    exact_plan = import_module("exact").check_run(args) if infra.exact else None
    learned = import_module("reward_model").check_run(args) if args.learned_reward.reward_model else None
    train_dtype, rollout_dtype = resolve_precisions(args.precision, args.train_precision, args.rollout_precision)
    recompute = args.mismatch_from == "recompute"  # PG-Seq-IS: else pi_old of the metrics from the first mini-batch
    seed_everything(args.seed)
    # one run per directory, one at a time; nothing in it changes until every input is read and checked (run.start)
    run = rundir.RunDir(infra.run_dir or os.path.join("runs", f"{args.exp_name}_{args.seed}"), infra, device,
                        cli.run_config(__file__, args))

    # --- data: the tokenizer, the training and evaluation problems (the built-in task's, without --model)
    model_path, dataset, eval_paths = with_builtin_task(args.model, args.dataset, list(infra.eval_dataset))
    tokenizer, problems, eval_sets = data.load_task(model_path, dataset, eval_paths, args.prompt_template,
                                                    args.max_prompt_len, infra.eval_max_problems)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    reward = rewards.Reward(args.reward, args.truncated_reward, tokenizer, device, rank == 0, learned,
                            args.prompt_template, args.train_precision or args.precision, probe=problems[:8])

    # --- models: the trainer (FSDP2, fp32 master weights) and the sampler (its own copy, rollout precision)
    weights_path = run.resume_dir or model_path
    model = load_policy(weights_path, train_dtype, device, infra.gradient_checkpointing,
                        cpu_offload=infra.cpu_offload, compile=infra.compile and not infra.exact)
    params = list(model.parameters())
    # KL: the reference, the run's starting weights (not a resumed checkpoint's), frozen; loaded only with --kl-coef
    ref = load_reference(model_path, train_dtype, device, infra.cpu_offload, infra.compile) if args.kl_coef else None
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=args.adam_betas, weight_decay=args.weight_decay)
    scaler = LossScaler(enabled=train_dtype == torch.float16, max_consecutive_skips=infra.max_skipped_steps)
    monitor = metrics.MismatchMonitor(infra.kl_warn_factor, infra.kl_baseline_steps, exact=infra.exact)  # warnings
    sampler = make_sampler(infra, weights_path, rollout_dtype, device, args.seed, rank,
                           args.max_prompt_len + args.max_response_len, exact=exact_plan)
    if exact_plan:  # --exact: the trainer's forward on the engine's kernels (docs/exact.md)
        exact_plan.attach(model, sampler)
    print0(f"[setup] {world_size} rank(s) on {device.type}; train {args.train_precision or args.precision}, rollout "
           f"{args.rollout_precision or args.precision}; {sum(p.numel() for p in params) / 1e6:.1f}M parameters")
    parts = {"": (model, optimizer, {"scaler": scaler, "kl_monitor": monitor, "reward": reward})}  # a checkpoint
    start_step = run.load(parts, sampler)

    def run_eval(step: int) -> None:
        if eval_sets:
            sampler.wake_up()
            logger.log(rewards.evaluate(sampler, tokenizer, eval_sets, infra, args.max_response_len, args.reward,
                                        rank, world_size, device), step, advance=False)
            sampler.sleep()

    # before any step: do the forward's activations fit the train and rollout precisions? (a clear error now, rather
    # than steps skipped for fp16 overflows or rollouts sampled from NaN)
    first_batch = batches.batch_problems(problems, start_step, args.num_prompts, rank, world_size, args.seed)
    preflight.check_forward_range(model, [p["prompt_ids"] for p in first_batch], pad_id, device, train_dtype,
                                  rollout_dtype, infra.logprob_chunk)
    run.start(start_step)  # every input is read and checked: only now does the run directory change
    logger = Logger(run.path, run.config, rank == 0, args.num_steps, start_step, infra.track, infra.wandb_project,
                    args.exp_name)
    if start_step == 0 and infra.eval_every:
        run_eval(0)  # the starting point
    step = start_step
    for step in cli.steps(start_step + 1, args.num_steps):
        stats = metrics.StepStats(device)  # this step's metrics, reduced over the ranks once, in 7
        # --- 1. sample G responses per prompt with the sampler (weights = the current policy, rollout precision)
        with stats.phase("sample"):
            sampler.wake_up()
            batch = batches.batch_problems(problems, step - 1, args.num_prompts, rank, world_size, args.seed)
            rollout = sampler.generate([p["prompt_ids"] for p in batch], args.group_size, args.max_response_len,
                                       args.temperature)
            stats.memory("sample")  # while the sampler is awake
            sampler.sleep()
        rollout.log(stats)  # response lengths, truncation, tokens per second

        # --- 2. rewards and advantages (groups are whole on each rank)
        rewards_B = reward(step, rollout, batch, stats)
        adv_B = drgrpo_advantages(rewards_B, args.group_size)

        # --- 3. recompute old_logp with the trainer (the weights that sampled the batch), and the entropy; with
        # --exact only now and then (cli.recompute_due: old_logp is mu bit for bit, and the count checks it)
        recomputed = recompute and cli.recompute_due(infra, step, start_step + 1)
        with stats.phase("recompute"):
            groups = batches.micro_batches(rollout.seq_lens(), args.micro_batch_tokens, device) if recomputed or ref \
                else []
            old_logp = logprobs.recompute_logprobs(model, rollout, groups if recomputed else [], pad_id,
                                                   args.temperature, infra.logprob_chunk, device, stats)
            # KL: the reference's log-probs of the same micro-batches, no gradient (also where no recompute is due)
            ref_BT = rollout.padded(logprobs.recompute_logprobs(ref, rollout, groups, pad_id, args.temperature,
                                                                infra.logprob_chunk, device)) if ref else None

        # --- 4. the mismatch of the sampler's mu_logp and the trainer's old_logp, every response token
        mask_BT, mu_BT = rollout.mask(), rollout.padded(rollout.logprobs)
        old_BT = rollout.padded(old_logp) if recomputed else mu_BT
        check_finite_logprobs(step, mask_BT, device, train_dtype, rollout_dtype, old_logp=old_BT, mu_logp=mu_BT)
        if recomputed:  # (else from the first mini-batch's forward, in 5)
            measure(stats, old_BT, mu_BT, mask_BT, args.is_threshold, True, TOKEN_CLIP)
        metrics.reference_kl(stats, old_BT, ref_BT, mask_BT)  # KL: how far pi_old is from the reference (kl_ref/*)

        # --- 5. num_minibatches optimizer steps over the rollout batch (whole groups per mini-batch)
        with stats.phase("train"):
            model.train()
            minibatches = batches.minibatches(rollout.seq_lens(), args.num_minibatches, args.micro_batch_tokens,
                                              device)
            num_seqs = len(rewards_B) // args.num_minibatches * world_size  # N_seq of the normalizer: all ranks
            for k, minibatch in enumerate(minibatches):
                for idx in minibatch:
                    ids, attn, rmask = rollout.rows(idx, pad_id, device)
                    first = k == 0 and not recomputed  # before any update: these are pi_old's log-probs
                    logp_BT, ent_BT = model(ids, attn, rmask, args.temperature, infra.logprob_chunk,
                                            with_entropy=first)
                    old_mb, mu_mb, adv_mb, ref_mb = batches.on_device(device, idx, rmask.shape[1], old_BT, mu_BT,
                                                                      adv_B, ref_BT)
                    if first:  # the mismatch of this micro-batch, as step 4 measures it after a recompute
                        measure(stats, logp_BT.detach(), mu_mb, rmask, args.is_threshold, True, TOKEN_CLIP)  # PG-Seq-IS
                        stats.add("train/entropy", ent_BT.detach()[rmask].sum(), rmask.sum())
                    loss, loss_stats, rho_max = policy_loss(logp_BT, old_mb if recompute else None, mu_mb, adv_mb,
                                                            rmask, args.is_mode, args.is_threshold,
                                                            args.max_response_len, num_seqs, ref_mb, args.kl_coef)
                    stats.max("is/ratio_max", rho_max)  # PG-Seq-IS
                    # FSDP averages gradients over ranks; times world_size makes that the global sum
                    scaler.scale_loss(loss * world_size).backward()
                    stats.add("train/loss", loss.detach() / args.num_minibatches)  # the mini-batches' mean loss
                    stats.update(loss_stats)
                scaler.step(params, optimizer, args.max_grad_norm)
                if scaler.fault:
                    break  # no more updates from this batch; the run stops after logging it

        # --- 6. push the new weights to the sampler
        with stats.phase("sync"):
            sampler.load_weights(iter_full_state(model.lm, rollout_dtype, device))

        # --- 7. log
        step_metrics = {**stats.reduce(), **scaler.log(), "optim/lr": args.lr}
        kl_metrics, warning = monitor.update(step_metrics)
        logger.log({**step_metrics, **kl_metrics}, step)
        if warning:
            print0(warning)
        if scaler.fault:  # a skipped step left the weights untouched: they are the last good state; keep it and stop
            run.save(step, tokenizer, parts, sampler)
            raise TrainingFault(f"step {step}: {scaler.fault}; the last good state is saved in {run.checkpoints}")
        if infra.eval_every and step % infra.eval_every == 0 and step < args.num_steps:
            run_eval(step)
        if infra.save_every and step % infra.save_every == 0 and step < args.num_steps:
            run.save(step, tokenizer, parts, sampler)

    if step > start_step:  # before the final evaluation, whose sampling would advance the saved sampler stream
        run.save(step, tokenizer, parts, sampler)
    run_eval(step)
    logger.close()
    sampler.shutdown()  # (vLLM's engine needs the process group for its own clean-up)


if __name__ == "__main__":
    cli.run(main, parse_args)

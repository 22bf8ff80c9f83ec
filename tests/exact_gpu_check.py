"""Exact mode on a GPU, end to end, for one model and precision: vLLM samples in batch-invariant mode, the trainer
(FSDP2, exact forward) recomputes, and every response token's old_logp must equal mu bit for bit. One engine per
process: tests/test_exact_gpu.py runs this in a subprocess per case (under torchrun for two ranks); prints one line
"RESULT {json}" (rank 0, every rank's counts).

    python tests/exact_gpu_check.py --model DIR --precision bf16
    torchrun --nproc_per_node 2 tests/exact_gpu_check.py --model DIR --precision bf16

Phases, each compared token by token with the sampler's mu: "t1" (temperature 1, mixed prompt and response lengths,
recomputed in micro-batches of one token budget), "t1_rebatched" (the same tokens in micro-batches of another
budget: other batch compositions), "t0.7" (temperature 0.7: vLLM's temperature kernel), "train" (one micro-batch in
train mode, with gradient checkpointing and gradients: the first mini-batch's pi_theta), "after_sync" (one AdamW step,
the sampler asleep, the new weights loaded into it, awake, a new rollout)."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.batches import micro_batches  # noqa: E402
from common.dist import setup_distributed  # noqa: E402
from exact import describe, enable_exact, plan_for_run  # noqa: E402
from common.fsdp import iter_full_state, load_policy  # noqa: E402
from common.logprobs import collate, recompute_logprobs  # noqa: E402
from common.metrics import StepStats  # noqa: E402
from common.precision import DTYPES  # noqa: E402
from common.vllm_sampler import VLLMSampler  # noqa: E402
from sanity.exact_probe import compare_logprobs as compare, rollout_mixed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--precision", required=True, choices=["fp16", "bf16"])
    ap.add_argument("--engine", default="graphs", help="how vLLM runs the model (exact.ENGINES)")
    ap.add_argument("--prompts", type=int, default=12, help="prompts per rank (4 responses each at temperature 1)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    a = ap.parse_args()
    rank, world, device = setup_distributed()
    dtype = DTYPES[a.precision]
    plan = plan_for_run(a.model, train_precision=a.precision, rollout_precision=a.precision, sampler="vllm",
                        vllm_tp=1, top_p=1.0, engine=a.engine)
    t0 = time.perf_counter()
    model = load_policy(a.model, dtype, device, gradient_checkpointing=True, compile=False)
    sampler = VLLMSampler(a.model, DTYPES[a.precision], seed=1000 + rank, max_model_len=a.max_model_len,
                          gpu_memory_utilization=0.35, sleep_level=1, exact=plan)
    enable_exact(model, plan, sampler.exact_facts)
    r = {"rank": rank, "world": world, "precision": a.precision, "exact": describe(plan, sampler.exact_facts),
         "start_s": round(time.perf_counter() - t0, 1), "phases": {}}
    vocab = model.lm.config.vocab_size
    g = torch.Generator().manual_seed(rank)
    # prompt lengths 3..700 and response limits 1..300 (an eager engine's decode steps are what takes the time)
    plens = torch.randint(3, 700, (a.prompts,), generator=g).tolist()
    limits = [1, 17, 64, 300, 150, 5, 129, 250, 33, 256, 2, 200][:a.prompts]
    limits += torch.randint(1, 300, (max(0, a.prompts - len(limits)),), generator=g).tolist()
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in plens]

    def recompute(out, budget, temperature=1.0):
        lens = [len(p) + len(x) for p, x in zip(out.prompt_ids, out.response_ids)]
        # (micro_batches: the same number of forwards on every rank, each a collective under FSDP2)
        return recompute_logprobs(model, out, micro_batches(lens, budget, device), 0, temperature, 2048, device,
                                  StepStats(device))

    phases = r["phases"]
    rollouts = {}
    for temperature, n in ((1.0, 4), (0.7, 2)):
        t = time.perf_counter()
        out = rollouts[temperature] = rollout_mixed(sampler, prompts, limits, n, temperature)
        sample_s = time.perf_counter() - t
        t = time.perf_counter()
        phases[f"t{temperature:g}"] = {**compare(recompute(out, 4096, temperature), out.logprobs),
                                       "sample_s": round(sample_s, 2),
                                       "recompute_s": round(time.perf_counter() - t, 2)}
    first = rollouts[1.0]
    phases["t1_rebatched"] = compare(recompute(first, 16384), first.logprobs)
    # train mode, gradient checkpointing, autograd on: the first mini-batch's pi_theta equals pi_old equals mu
    sampler.sleep()
    model.train()
    idx = list(range(min(16, len(first.response_ids))))
    ids, attn, rmask = collate([first.prompt_ids[i] for i in idx], [first.response_ids[i] for i in idx], 0, device)
    logp_BT, _ = model(ids, attn, rmask, 1.0, 2048)
    (-(logp_BT * rmask).sum() / rmask.sum()).backward()
    params = list(model.parameters())
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    rows = [logp_BT[b, :len(first.response_ids[i])].detach().cpu() for b, i in enumerate(idx)]
    phases["train"] = {**compare(rows, [first.logprobs[i] for i in idx]),
                       "grads_finite": len(local) == len(params) and all(bool(torch.isfinite(x).all()) for x in local)}
    # one optimizer step (large enough to move 16-bit weights), the weights into the sleeping sampler, a new rollout
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moved = compare(recompute(first, 4096), first.logprobs)
    r["tokens_moved_by_step"] = moved["tokens"] - moved["equal"]  # > 0: the step changed the trainer's log-probs
    sampler.load_weights(iter_full_state(model.lm, dtype, device))
    sampler.wake_up()
    out = rollout_mixed(sampler, prompts, limits, 2, 1.0)
    phases["after_sync"] = compare(recompute(out, 4096), out.logprobs)
    gathered = [None] * world
    if world > 1:  # (before the sampler's shutdown, which may take the process group down)
        dist.all_gather_object(gathered, r)
    else:
        gathered = [r]
    sampler.shutdown()
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": gathered}), flush=True)


if __name__ == "__main__":
    main()

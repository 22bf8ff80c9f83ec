"""GPU checks of the vLLM sampler next to an FSDP2 trainer in one process, for one rollout precision; prints one JSON
line of figures. Run by tests/test_gpu.py in a subprocess per precision: vLLM's sleep-mode allocator allows one
engine per process.

  python tests/vllm_gpu_check.py --model DIR --precision fp16 --mode sync    # greedy vs HF, weight sync, sleep
  python tests/vllm_gpu_check.py --model DIR --precision fp16 --mode speed   # mismatch and tokens/s
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.dist import setup_distributed  # noqa: E402
from common.fsdp import iter_full_state, load_policy  # noqa: E402
from common.logprobs import collate  # noqa: E402
from common.precision import DTYPES  # noqa: E402
from common.vllm_sampler import VLLMSampler  # noqa: E402

PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [3, 3, 3, 13, 9, 14], [10, 11, 12], [5, 5, 5, 5], [8, 14, 9], [6], [12, 3]]


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def hf_greedy(hf, prompts, max_new):
    outs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=1, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def matches(vllm_ids, hf_ids):
    return sum(v == h[:len(v)] for v, h in zip(vllm_ids, hf_ids))


def logprob_diffs(trainer, out, device) -> torch.Tensor:
    """Trainer's minus sampler's log-prob of every sampled token (temperature 1)."""
    d_all = []
    for i in range(0, len(out.response_ids), 32):
        sub = type(out)(out.prompt_ids[i:i + 32], out.response_ids[i:i + 32], out.logprobs[i:i + 32])
        ids, attn, rmask = collate(sub.prompt_ids, sub.response_ids, 0, device)
        with torch.no_grad():
            logp, _ = trainer(ids, attn, rmask, 1.0, 4096)
        mu = torch.zeros_like(logp)
        for b, lp in enumerate(sub.logprobs):
            mu[b, :len(lp)] = lp.to(device)
        d_all.append((logp - mu)[rmask])
    return torch.cat(d_all)


def kl_k3(trainer, out, device) -> float:
    d = logprob_diffs(trainer, out, device)
    return float((torch.expm1(d) - d).mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--precision", required=True)
    ap.add_argument("--mode", choices=["sync", "speed"], required=True)
    a = ap.parse_args()
    _, _, device = setup_distributed()
    dtype = DTYPES[a.precision]
    trainer = load_policy(a.model, dtype, device, gradient_checkpointing=False)
    r = {"precision": a.precision, "mode": a.mode, "trainer_gib": round(used_gib(), 2)}
    t0 = time.perf_counter()
    max_len = min(1024, trainer.lm.config.max_position_embeddings)
    sampler = VLLMSampler(a.model, dtype, seed=0, max_model_len=max_len, gpu_memory_utilization=0.3,
                          sleep_level=1)
    r["engine_start_s"] = round(time.perf_counter() - t0, 1)
    r["with_engine_gib"] = round(used_gib(), 2)

    if a.mode == "sync":
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).cuda()
        greedy = lambda: sampler.generate(PROMPTS, 1, 16, 0.0).response_ids  # noqa: E731
        before = greedy()
        r["greedy_eq_hf_before"] = f"{matches(before, hf_greedy(hf, PROMPTS, 16))}/{len(PROMPTS)}"
        with torch.no_grad():  # new trainer weights, as large as the old ones (peaked distributions, no near-ties)
            torch.manual_seed(1)
            for p in trainer.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn_like(p) * 0.2)
        t0 = time.perf_counter()
        sampler.load_weights(iter_full_state(trainer.lm, dtype, device))
        torch.cuda.synchronize()
        r["sync_s"] = round(time.perf_counter() - t0, 3)
        hf.load_state_dict(dict(iter_full_state(trainer.lm, dtype)), strict=False)
        after = greedy()
        r["greedy_changed_by_sync"] = after != before
        r["kl_k3_after_sync"] = kl_k3(trainer, sampler.generate(PROMPTS, 8, 16, 1.0), device)
        r["greedy_eq_hf_after"] = f"{matches(after, hf_greedy(hf, PROMPTS, 16))}/{len(PROMPTS)}"
        for level in (1, 2):
            sampler.sleep_level = level
            awake = used_gib()
            sampler.sleep()
            asleep = used_gib()
            if level == 2:
                try:
                    sampler.wake_up()
                    r["level2_refuses_stale_weights"] = False
                except RuntimeError:
                    r["level2_refuses_stale_weights"] = True
                sampler.load_weights(iter_full_state(trainer.lm, dtype, device))
            sampler.wake_up()
            r[f"sleep{level}_gib"] = [round(awake, 2), round(asleep, 2), round(used_gib(), 2)]
            r[f"greedy_same_after_sleep{level}"] = greedy() == after
    else:
        prompts = [PROMPTS[i % len(PROMPTS)] + [3 + i % 10] * 8 for i in range(64)]
        sampler.generate(prompts[:4], 1, 8, 1.0)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = sampler.generate(prompts, 4, 512, 1.0)
        dt = time.perf_counter() - t0
        n_tok = sum(map(len, out.response_ids))
        r["rollout_tok_s"] = round(n_tok / dt)
        r["mean_response_len"] = round(n_tok / len(out.response_ids), 1)
        d = logprob_diffs(trainer, out, device)
        r["kl_k3"] = float((torch.expm1(d) - d).mean())
        r["logp_abs_diff_mean"] = float(d.abs().mean())
        r["logp_abs_diff_max"] = float(d.abs().max())
        t0 = time.perf_counter()
        sampler.load_weights(iter_full_state(trainer.lm, dtype, device))
        torch.cuda.synchronize()
        r["sync_s"] = round(time.perf_counter() - t0, 3)
    sampler.shutdown()
    print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()

"""The fallback sampler: its log-probs equal the trainer's on the same weights (fp32), greedy decoding equals
transformers' generate, the weight sync moves new weights in, top-p renormalises, seeds fix the stream."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.fsdp import iter_full_state, load_policy
from common.logprobs import collate
from common.hf_sampler import HFSampler, process_logits

PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [3, 3, 3, 13, 9, 14]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_trainer_logprobs_fp32(tiny_model_dir, process_group, temperature):
    _, _, device = process_group
    sampler = HFSampler(tiny_model_dir, torch.float32, device, seed=0, batch_size=4)  # 3 decode batches
    out = sampler.generate(PROMPTS, n=3, max_new_tokens=12, temperature=temperature)
    assert len(out.response_ids) == 9 and out.prompt_ids[3] == PROMPTS[1]
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=False)
    ids, attn, rmask = collate(out.prompt_ids, out.response_ids, 0, device)
    with torch.no_grad():
        logp, _ = model(ids, attn, rmask, temperature, chunk_size=5)
    for b, (r, mu, fin) in enumerate(zip(out.response_ids, out.logprobs, out.finished)):
        assert mu.dtype == torch.float32 and len(mu) == len(r) > 0
        assert fin == (r[-1] == 1) and (fin or len(r) == 12)  # finished iff it ends with eos; else cut at the limit
        assert 1 not in r[:-1]  # nothing after the end-of-sequence token
        torch.testing.assert_close(logp[b, :len(r)].cpu(), mu, atol=2e-5, rtol=0)  # (a Rollout's log-probs: on the CPU)


def test_greedy_equals_hf_generate_before_and_after_weight_sync(tiny_model_dir, process_group):
    _, _, device = process_group
    sampler = HFSampler(tiny_model_dir, torch.float32, device, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def hf_greedy(prompt):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=1, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def check():
        got = sampler.generate(PROMPTS, n=1, max_new_tokens=8, temperature=0.0)
        for p, r in zip(PROMPTS, got.response_ids):
            ref = hf_greedy(p)
            assert r == ref[:len(r)] and (len(r) == 8 or ref[len(r) - 1] == 1)

    check()
    # change the trainer's weights, sync them into the sampler: the sampler must now follow the new weights
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    before = sampler.generate(PROMPTS, n=1, max_new_tokens=8, temperature=0.0).response_ids
    sampler.load_weights(iter_full_state(model.lm, torch.float32, device))
    hf.load_state_dict({k: v for k, v in iter_full_state(model.lm)}, strict=False)
    after = sampler.generate(PROMPTS, n=1, max_new_tokens=8, temperature=0.0).response_ids
    assert before != after
    check()


def test_weight_sync_refuses_an_incomplete_update(tiny_model_dir, process_group):
    _, _, device = process_group
    sampler = HFSampler(tiny_model_dir, torch.float32, device, seed=0)
    with pytest.raises(RuntimeError, match="not sent"):
        sampler.load_weights(iter([]))


def test_same_seed_same_samples_other_seed_other_samples(tiny_model_dir, process_group):
    _, _, device = process_group
    a = HFSampler(tiny_model_dir, torch.float32, device, seed=1).generate(PROMPTS, 4, 10, 1.0).response_ids
    b = HFSampler(tiny_model_dir, torch.float32, device, seed=1).generate(PROMPTS, 4, 10, 1.0).response_ids
    c = HFSampler(tiny_model_dir, torch.float32, device, seed=2).generate(PROMPTS, 4, 10, 1.0).response_ids
    assert a == b and a != c


def test_streams_of_runs_with_other_seeds_never_coincide(tiny_model_dir, process_group):
    """The sampler of (seed, rank) is seeded from the pair: rank 1 of seed 1 and rank 0 of seed 2 once both drew from
    seed 2. Every (seed, rank) of a grid gets its own stream, vLLM's per TP group too."""
    from common.dist import stream_seed
    from common.cli import Infra
    from common.sampler import make_sampler
    _, _, device = process_group
    seeds = {(s, r): stream_seed(s, r) for s in range(1, 9) for r in range(64)}
    assert len(set(seeds.values())) == len(seeds)
    flags = Infra(sampler="hf", sampler_batch_size=8)
    samplers = [make_sampler(flags, tiny_model_dir, torch.float32, device, seed, rank, 64)
                for seed, rank in ((1, 1), (2, 0))]
    assert samplers[0].generator.initial_seed() != samplers[1].generator.initial_seed()
    a, b = (s.generate(PROMPTS, 4, 10, 1.0).response_ids for s in samplers)
    assert a != b


def test_top_p_renormalises_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = process_logits(logits, temperature=1.0, top_p=0.75)  # keeps 0.5 and 0.3 (0.5 < 0.75 <= 0.8)
    torch.testing.assert_close(lp.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    lp = process_logits(logits, temperature=2.0, top_p=1.0)
    torch.testing.assert_close(lp, torch.log_softmax(logits / 2.0, -1))

"""Chunked fp32 log-probs equal a plain log_softmax (values and gradients); the FSDP2-wrapped policy gives the same
log-probs as the plain Hugging Face forward; micro-batch splitting."""
import math

import pytest
import torch
from conftest import assert_close_to_rounding, fp32_rounding_bound
from transformers import AutoConfig, AutoModelForCausalLM

from common.batches import Rollout
from common.fsdp import load_policy
from common.logprobs import chunked_logprobs, collate, recompute_logprobs, split_microbatches
from common.metrics import StepStats


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_equals_plain_log_softmax(chunk):
    torch.manual_seed(0)
    h = torch.randn(10, 16, requires_grad=True)
    W = torch.randn(50, 16, requires_grad=True)
    tgt = torch.randint(0, 50, (10,))
    lp, ent = chunked_logprobs(h, W, tgt, temperature=0.7, chunk_size=chunk, with_entropy=True)
    ref_all = torch.log_softmax((h @ W.T) / 0.7, dim=-1)
    ref = ref_all.gather(-1, tgt[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(ent, -(ref_all.exp() * ref_all).sum(-1))
    # the entropy is a metric without a graph: with one, the backward's recompute of each checkpointed chunk kept that
    # chunk's fp32 log-softmax alive to the end (+25 GiB at 1.5B, 64 x 8 x 512, --exact's first mini-batch)
    assert not ent.requires_grad
    g1 = torch.autograd.grad(lp.sum(), (h, W))
    g2 = torch.autograd.grad(ref.sum(), (h, W))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_fp16_weights_still_give_fp32_logprobs():
    h, W = torch.randn(4, 8, dtype=torch.float16), torch.randn(20, 8, dtype=torch.float16)
    lp, _ = chunked_logprobs(h, W, torch.zeros(4, dtype=torch.long), 1.0, 2)
    assert lp.dtype == torch.float32


def test_policy_model_matches_hf_forward(tiny_model_dir, process_group):
    _, _, device = process_group
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts, responses = [[4, 5, 13], [7, 8, 9, 10, 14]], [[6, 7, 1], [3, 1]]
    ids, attn, rmask = collate(prompts, responses, 0, device)
    logp, _ = model(ids, attn, rmask, temperature=0.8, chunk_size=2)
    # one row at a time on the CPU against a padded batch, on a GPU where there is one: other kernels, other orders
    bound = fp32_rounding_bound(AutoConfig.from_pretrained(tiny_model_dir), ids.shape[1], 0, backward=False)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        logits = hf(torch.tensor([p + r])).logits[0].float() / 0.8
        ref = torch.log_softmax(logits, -1)[len(p) - 1:len(p) + len(r) - 1].gather(-1, torch.tensor(r)[:, None])
        assert_close_to_rounding(logp[b, :len(r)].cpu(), ref.squeeze(-1), bound)
        assert (logp[b, len(r):] == 0).all()


def test_recompute_logprobs_row_by_row_as_one_forward(tiny_model_dir, process_group):
    """Step 3 (recompute_logprobs) cut into micro-batches gives each sequence the log-probs and entropy of one forward
    over all rows: the padding of a micro-batch changes nothing (fp32: the same kernels on other batch shapes may sum
    in other orders, so the differences are bounded by rounding: fp32_rounding_bound); a sequence in no group gets
    None."""
    _, _, device = process_group
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=False)
    prompts, responses = [[4, 5, 13], [7, 8, 9, 10, 14], [3, 3]], [[6, 7, 1], [3, 1], [5, 6, 7, 8]]
    ids, attn, rmask = collate(prompts, responses, 0, device)
    with torch.no_grad():
        ref, ent = model(ids, attn, rmask, 0.8, 2, with_entropy=True)
    rollout = Rollout(prompts, responses, [None] * 3, [True] * 3)
    stats = StepStats(device)
    logp = recompute_logprobs(model, rollout, [[2], [0, 1]], 0, 0.8, 2, device, stats)
    entropy_sum = stats.reduce()["train/entropy"] * sum(map(len, responses))  # a mean over the response tokens
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    bound = fp32_rounding_bound(cfg, ids.shape[1], 0, backward=False)
    for b, r in enumerate(responses):
        assert logp[b].shape == (len(r),) and logp[b].device.type == "cpu"
        assert_close_to_rounding(logp[b], ref[b, :len(r)].cpu(), bound)
    # the entropy: a sum over the 9 response tokens of values <= log(vocab) each, every one within the bound of it
    n_tok, log_v = int(rmask.sum()), math.log(cfg.vocab_size)
    tol = (bound + n_tok * torch.finfo(torch.float32).eps) * n_tok * log_v  # + the sum of n_tok terms itself
    assert abs(entropy_sum - ent[rmask].sum().item()) <= tol
    assert recompute_logprobs(model, rollout, [[1]], 0, 0.8, 2, device, stats)[::2] == [None, None]


def test_split_microbatches_respects_budget_and_min_count():
    lengths = [5, 9, 3, 9, 2, 7]
    groups = split_microbatches(lengths, token_budget=18)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(len(g) * max(lengths[i] for i in g) <= 18 for g in groups)
    forced = split_microbatches(lengths, token_budget=1000, min_count=4)
    assert len(forced) == 4 and sorted(i for g in forced for i in g) == list(range(6))
    assert split_microbatches([100], token_budget=10) == [[0]]  # a longer row alone, not dropped


def _greedy_count(lengths, budget):
    """The fewest micro-batches of longest-first rows that fit `budget` (each row alone past it): the reference."""
    count, rows, first = 0, 0, 0
    for n in sorted(lengths, reverse=True):
        if count and (rows + 1) * first <= budget:
            rows += 1
        else:
            count, rows, first = count + 1, 1, n
    return count


@pytest.mark.parametrize("seed", range(20))
def test_split_microbatches_are_as_few_as_fit_and_even(seed):
    """As many micro-batches as the budget needs and no more, each within it, but no row or two left over for the last
    one: under torch.compile a one-row micro-batch, and a small one, is a graph of its own (a recompile at the step
    that first has one). The budget that is split: the smallest that needs as many."""
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 1536, (int(torch.randint(2, 200, (1,), generator=rng)),), generator=rng).tolist()
    budget = int(torch.randint(1536, 16384, (1,), generator=rng))
    groups = split_microbatches(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) == _greedy_count(lengths, budget)
    padded = [len(g) * max(lengths[i] for i in g) for g in groups]
    assert max(padded) <= budget
    if len(groups) > 1:  # a smaller budget would need one more: what is split is as even as the sizes allow
        assert _greedy_count(lengths, max(padded) - 1) > len(groups)


def test_split_microbatches_leave_no_row_alone():
    assert [len(g) for g in split_microbatches([100] * 21, token_budget=1000)] == [7, 7, 7]  # not 10, 10, 1
    assert [len(g) for g in split_microbatches([100] * 25, token_budget=1000)] == [9, 9, 7]
    assert sorted(len(g) for g in split_microbatches([100] * 6, token_budget=1000, min_count=4)) == [1, 1, 2, 2]


def test_compiled_layers_take_a_micro_batch_without_padding_without_recompiling(tiny_model_dir, monkeypatch):
    """Under torch.compile (compile_layers, on a GPU) every micro-batch takes one graph per grad mode once the shapes
    went dynamic: from a 2-D mask, Hugging Face drops the mask of a micro-batch without padding (SDPA's is_causal), and
    that path was a new graph at whatever step first had one (6-13 s of steps 2 and 3 at 8K on one H200). Dynamo's
    eager backend: its guards, without inductor's compile time."""
    import functools

    import torch._dynamo
    from common.fsdp import compile_layers
    from common.logprobs import PolicyModel
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    model = PolicyModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    compile_layers(model.lm)

    def forward(prompts, responses):
        with torch.no_grad():
            logp, _ = model(*collate(prompts, responses, 0, "cpu"), temperature=1.0, chunk_size=4)
        return logp
    forward([[4, 5, 6], [7, 8]], [[9, 10], [11]])  # a graph for these shapes,
    forward([[4, 5, 6, 7], [7, 8], [3]], [[9, 10, 3], [11], [5, 6]])  # then one for any (dynamic) shapes
    compiled = len(graphs)
    assert compiled >= 1
    forward([[4, 5, 6], [7, 8, 9]], [[9, 10], [11, 12]])  # no padding
    forward([[4, 5], [7, 8, 9], [3, 4], [6]], [[9, 10, 3], [11], [5, 6], [7]])
    assert len(graphs) == compiled
    torch._dynamo.reset()

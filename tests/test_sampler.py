"""The fallback sampler: its log-probs equal the trainer's on the same weights (fp32), greedy decoding equals
transformers' generate, the weight sync moves new weights in, top-p renormalises, seeds fix the stream. The
static-cache decoding (the GPU default, with CUDA graphs there) equals the eager DynamicCache decoding on a CPU:
same tokens, log-probs to float rounding; its decode step has no host synchronisation (which a CUDA graph capture
forbids), and the graph-replay plumbing works with a CPU stand-in for the graph."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.fsdp import iter_full_state, load_policy
from common.logprobs import collate
from common.hf_sampler import HFSampler, process_logits

PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [3, 3, 3, 13, 9, 14]]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_trainer_logprobs_fp32(tiny_model_dir, process_group, temperature, static):
    _, _, device = process_group
    sampler = HFSampler(tiny_model_dir, torch.float32, device, seed=0, batch_size=4,  # 3 decode batches
                        static_cache=static)
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


@pytest.mark.parametrize("static", [False, True])
def test_greedy_equals_hf_generate_before_and_after_weight_sync(tiny_model_dir, process_group, static):
    _, _, device = process_group
    sampler = HFSampler(tiny_model_dir, torch.float32, device, seed=0, static_cache=static)
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


# ---------------------------------------------------------------------------------------------------------------
# Static-cache decoding (what a GPU runs, there replayed as a CUDA graph) against the eager DynamicCache decoding

PROMPTS4 = PROMPTS + [[12, 3, 9]]


def _same_rollouts(a, b, atol=1e-5):
    """Same tokens and end flags; log-probs equal to float rounding (the decode attention is a different sdpa call:
    grouped query heads over the whole static cache, against transformers' sdpa over the tokens so far; measured
    max difference 4e-6)."""
    assert a.response_ids == b.response_ids and a.finished == b.finished and a.prompt_ids == b.prompt_ids
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_static_cache_decoding_equals_dynamic_cache_decoding(tiny_model_dir, process_group, temperature, top_p):
    _, _, device = process_group
    # 16 rows in decode batches of 4 and 8 (powers of two: no filler rows, so both draw the same random numbers)
    for batch_size in (4, 8):
        dyn = HFSampler(tiny_model_dir, torch.float32, device, seed=5, batch_size=batch_size, static_cache=False)
        sta = HFSampler(tiny_model_dir, torch.float32, device, seed=5, batch_size=batch_size, static_cache=True)
        assert not dyn.static_cache and sta.static_cache and sta.cuda_graph == (device.type == "cuda")  # graphs: GPU
        a = dyn.generate(PROMPTS4, 4, 20, temperature, top_p)
        b = sta.generate(PROMPTS4, 4, 20, temperature, top_p)
        _same_rollouts(a, b)
        assert any(len(r) == 20 for r in a.response_ids) and any(f for f in a.finished)  # both ways of ending
        # the second call reuses the bucket's decode state (one graph per bucket on a GPU) and continues the stream
        state = sta._static
        _same_rollouts(dyn.generate(PROMPTS4, 4, 20, temperature, top_p),
                       sta.generate(PROMPTS4, 4, 20, temperature, top_p))
        assert sta._static is state


def test_static_cache_filler_rows_and_buckets(tiny_model_dir, process_group):
    """3 rows decode in a bucket of 4 (one filler row, which never holds up the early exit); greedy tokens are
    those of the DynamicCache decoding. Another prompt length within the same cache-length bucket keeps the state."""
    _, _, device = process_group
    dyn = HFSampler(tiny_model_dir, torch.float32, device, seed=0, batch_size=4, static_cache=False)
    sta = HFSampler(tiny_model_dir, torch.float32, device, seed=0, batch_size=4, static_cache=True)
    _same_rollouts(dyn.generate(PROMPTS, 1, 16, 0.0), sta.generate(PROMPTS, 1, 16, 0.0))
    assert sta._static.key == (4, 256)  # 3 rows -> 4; 6 + 16 tokens -> a cache of 256
    state = sta._static
    out = sta.generate([[5, 6]], 1, 16, 1.0)  # 1 row: a bucket of 1
    assert len(out.response_ids) == 1 and sta._static.key == (1, 256) and sta._static is not state
    sta.sleep()  # frees the state; the next call makes a new one
    assert sta._static is None
    _same_rollouts(dyn.generate(PROMPTS, 1, 16, 0.0), sta.generate(PROMPTS, 1, 16, 0.0))


def test_static_cache_follows_weight_sync_between_calls(tiny_model_dir, process_group):
    """load_weights between generate calls: the static path (same parameter tensors, same decode state) decodes
    with the new weights, as the DynamicCache path does."""
    _, _, device = process_group
    dyn = HFSampler(tiny_model_dir, torch.float32, device, seed=0, batch_size=4, static_cache=False)
    sta = HFSampler(tiny_model_dir, torch.float32, device, seed=0, batch_size=4, static_cache=True)
    before = sta.generate(PROMPTS4, 1, 12, 0.0)
    state = sta._static
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    for s in (dyn, sta):
        s.load_weights(iter_full_state(model.lm, torch.float32, device))
    after = sta.generate(PROMPTS4, 1, 12, 0.0)
    assert sta._static is state and after.response_ids != before.response_ids
    _same_rollouts(dyn.generate(PROMPTS4, 1, 12, 0.0), after)


class _StandInGraph:
    """A CPU stand-in for a captured CUDA graph: replay() recomputes the decode step into the same output buffer,
    as a graph replay writes into its captured output."""

    def __init__(self, sampler, st):
        self.sampler, self.st = sampler, st

    def replay(self):
        self.st.logits.copy_(self.sampler._decode_forward(self.st))


def _stand_in_capture(self, st):
    st.mask[:, 0, 0, :5] = 0.0
    st.logits = self._decode_forward(st).clone()  # allocates the cache, as the first eager step does on a GPU
    st.graph = _StandInGraph(self, st)


def test_graph_replay_plumbing_with_a_cpu_stand_in(tiny_model_dir, process_group, monkeypatch):
    """The graph path of generate (replay into a fixed output buffer, consumed before the next replay; the cache
    reset between batches and calls) gives the eager static path's rollouts exactly."""
    _, _, device = process_group
    monkeypatch.setattr(HFSampler, "_capture", _stand_in_capture)
    eager = HFSampler(tiny_model_dir, torch.float32, device, seed=2, batch_size=4, static_cache=True)
    graph = HFSampler(tiny_model_dir, torch.float32, device, seed=2, batch_size=4, static_cache=True)
    graph.cuda_graph = True  # (a CPU sampler refuses the flag itself)
    for temperature in (1.0, 0.0):
        a = eager.generate(PROMPTS4, 3, 14, temperature)
        b = graph.generate(PROMPTS4, 3, 14, temperature)
        assert isinstance(graph._static.graph, _StandInGraph)
        _same_rollouts(a, b, atol=0)


def test_failed_capture_falls_back_to_eager_static_decoding(tiny_model_dir, process_group, monkeypatch, capsys):
    _, _, device = process_group

    def failing_capture(self, st):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(HFSampler, "_capture", failing_capture)
    ref = HFSampler(tiny_model_dir, torch.float32, device, seed=2, batch_size=4, static_cache=True)
    s = HFSampler(tiny_model_dir, torch.float32, device, seed=2, batch_size=4, static_cache=True)
    s.cuda_graph = True
    _same_rollouts(ref.generate(PROMPTS4, 2, 10, 1.0), s.generate(PROMPTS4, 2, 10, 1.0), atol=0)
    assert not s.cuda_graph and s.static_cache and "CUDA graph capture failed" in capsys.readouterr().out


def test_unusable_static_cache_falls_back_to_dynamic_cache(tiny_model_dir, process_group, monkeypatch, capsys):
    """A transformers version whose StaticCache does not append where this code expects, or without the attention
    registry: the sampler says so and decodes with the DynamicCache, with the same results."""
    _, _, device = process_group
    import common.hf_sampler as sampler_module

    class ShiftedStaticCache(sampler_module.StaticCache):
        def get_seq_length(self, layer_idx=0):
            return int(super().get_seq_length(layer_idx)) + 1
    monkeypatch.setattr(sampler_module, "StaticCache", ShiftedStaticCache)
    dyn = HFSampler(tiny_model_dir, torch.float32, device, seed=4, batch_size=4, static_cache=False)
    s = HFSampler(tiny_model_dir, torch.float32, device, seed=4, batch_size=4, static_cache=True)
    _same_rollouts(dyn.generate(PROMPTS4, 2, 10, 1.0), s.generate(PROMPTS4, 2, 10, 1.0))
    assert not s.static_cache and "static-cache decoding unavailable" in capsys.readouterr().out
    # nor the attention registry: the sampler loads the model with plain sdpa and decodes as before

    def no_registry():
        raise ImportError("cannot import name 'AttentionMaskInterface'")
    monkeypatch.setattr(sampler_module, "_register_decode_attention", no_registry)
    s = HFSampler(tiny_model_dir, torch.float32, device, seed=4, batch_size=4, static_cache=True)
    assert not s.static_cache and s.model.config._attn_implementation == "sdpa"
    assert "static-cache decoding unavailable" in capsys.readouterr().out
    ref = HFSampler(tiny_model_dir, torch.float32, device, seed=4, batch_size=4, static_cache=False)
    _same_rollouts(ref.generate(PROMPTS4, 2, 10, 1.0), s.generate(PROMPTS4, 2, 10, 1.0), atol=0)


def test_decode_step_has_no_host_synchronisation(tiny_model_dir, process_group):
    """What a CUDA graph capture forbids (a GPU->CPU read such as .item() or nonzero(), a tensor made from Python
    data) does not occur in the static decode step: every aten op it dispatches is recorded on a CPU and checked."""
    from torch.utils._python_dispatch import TorchDispatchMode
    _, _, device = process_group
    s = HFSampler(tiny_model_dir, torch.float32, device, seed=0, batch_size=4, static_cache=True)
    logits, cache, attn, pos = s._prefill(PROMPTS, 4)
    step = s._static_decoder(cache, attn, pos[:, -1:], attn.shape[1] + 8)

    class Record(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))
    with Record() as rec:
        s._decode_forward(s._static)
    forbidden = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal",
                 "aten.lift_fresh", "aten.masked_select", "aten.unique", "aten._assert_async"}
    assert rec.ops and not forbidden & set(rec.ops), sorted(forbidden & set(rec.ops))
    assert "aten.index_copy_" in rec.ops  # the step writes into the static cache in place
    assert step(torch.tensor([4, 5, 6, 7]), attn.shape[1]).shape == (4, len(s.params["lm_head.weight"]))

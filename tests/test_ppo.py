"""ppo.py's pure functions against hand-computed values (GAE, whitening, value loss, policy loss on per-token
advantages), the critic wrapper (critic.py), and ppo.py end to end on the built-in task under torchrun."""
import json
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.fsdp import load_policy
from common.logprobs import collate
from safetensors.torch import load_file, save_file

from critic import ValueHeadState, init_value_head, load_critic
from ppo import gae_advantages, policy_loss, value_loss, whiten_advantages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------------------
# GAE and whitening

def test_gae_hand_computed_with_gamma_and_lambda_below_one():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    values = torch.tensor([[0.5, 0.6, 0.2], [0.3, -0.1, 9.0]])  # seq 1's third token is padding (its 9.0 is ignored)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0])
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    # seq 0 (reward 1 on its last token, V after it = 0):
    #   t=2: delta = 1 + 0.9*0   - 0.2 =  0.8                 A2 = 0.8
    #   t=1: delta = 0 + 0.9*0.2 - 0.6 = -0.42                A1 = -0.42 + 0.72*0.8   = 0.156
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 =  0.04                A0 =  0.04 + 0.72*0.156 = 0.15232
    #   R = A + V = [0.65232, 0.756, 1.0]
    # seq 1 (reward 0, two tokens):
    #   t=1: delta = 0 + 0.9*0    - (-0.1) = 0.1              A1 = 0.1
    #   t=0: delta = 0 + 0.9*-0.1 - 0.3    = -0.39            A0 = -0.39 + 0.72*0.1 = -0.318
    #   R = [-0.018, 0.0], and 0 on the padding
    torch.testing.assert_close(adv, torch.tensor([[0.15232, 0.156, 0.8], [-0.318, 0.1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.65232, 0.756, 1.0], [-0.018, 0.0, 0.0]]))


def test_gae_with_gamma_and_lambda_one_returns_the_terminal_reward_everywhere():
    torch.manual_seed(0)
    values = torch.randn(5, 6)
    lengths = torch.tensor([6, 1, 3, 4, 2])
    mask = torch.arange(6)[None] < lengths[:, None]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    adv, ret = gae_advantages(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(ret, rewards[:, None].expand(5, 6) * mask)
    torch.testing.assert_close(adv, (rewards[:, None] - values) * mask)  # A_t = r - V_t: Monte-Carlo minus baseline


def test_whitening_gives_mean_zero_std_one_over_masked_tokens():
    torch.manual_seed(0)
    adv = torch.randn(6, 5) * 3 + 2
    mask = torch.rand(6, 5) > 0.3
    white, std_raw = whiten_advantages(adv, mask)
    assert std_raw == pytest.approx(adv[mask].std(unbiased=False).item(), rel=1e-6)  # critic/adv_std_raw
    assert white.dtype == torch.float32
    assert white[mask].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert white[mask].std().item() == pytest.approx(1.0, abs=1e-6)  # unbiased std, as verl's masked_whiten
    assert (white[~mask] == 0).all()
    torch.testing.assert_close(white[mask], (adv[mask] - adv[mask].mean()) / adv[mask].std())


def _whiten_half(rank, port, adv, mask, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    half = adv.shape[0] // 2
    rows = slice(rank * half, (rank + 1) * half)
    out[rows] = whiten_advantages(adv[rows], mask[rows])[0]
    dist.destroy_process_group()


def test_whitening_statistics_are_global_over_ranks():
    """Two ranks, each whitening its half of the batch, give what one rank whitening the whole batch gives."""
    torch.manual_seed(0)
    adv, mask = torch.randn(8, 5), torch.rand(8, 5) > 0.3
    mask[:4] &= torch.arange(5) < 2  # the halves differ in token counts and statistics
    adv[4:] += 3
    out = torch.zeros(8, 5).share_memory_()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_whiten_half, args=(port, adv, mask, out), nprocs=2)
    torch.testing.assert_close(out, whiten_advantages(adv, mask)[0])


# ----------------------------------------------------------------------------------------------------------------
# Value loss and policy loss

def value_case():
    # row 0: a, b, c; row 1: d, then a masked token and padding.  c = value_clip = 0.2
    V = torch.tensor([[0.5, 0.9, 0.0], [0.9, 5.0, 0.0]])
    V_old = torch.tensor([[0.4, 0.4, 0.4], [0.4, 0.0, 0.0]])
    R = torch.tensor([[1.0, 1.0, 0.0], [0.0, -3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return V, V_old, R, mask


def test_value_loss_hand_computed_with_the_clipped_branch():
    V, V_old, R, mask = value_case()
    loss, stats = value_loss(V, V_old, R, mask, 0.2, num_tokens=4)
    # a: V - V_old = 0.1 (inside the clip): V_c = 0.5, (V-R)^2 = (V_c-R)^2 = 0.25           -> 0.5 * 0.25 = 0.125
    # b: V - V_old = 0.5 -> V_c = 0.6: (0.9-1)^2 = 0.01 < (0.6-1)^2 = 0.16, clipped branch   -> 0.5 * 0.16 = 0.08
    # c: V - V_old = -0.4 -> V_c = 0.2: (0-0)^2 = 0 < (0.2-0)^2 = 0.04, clipped branch       -> 0.5 * 0.04 = 0.02
    # d: V - V_old = 0.5 -> V_c = 0.6: (0.9-0)^2 = 0.81 > (0.6-0)^2 = 0.36, unclipped branch -> 0.5 * 0.81 = 0.405
    # (0.125 + 0.08 + 0.02 + 0.405) / 4 tokens = 0.1575
    assert loss.item() == pytest.approx(0.1575, abs=1e-6)
    assert stats["critic/value_clip_frac"][0] == 2 and stats["critic/value_clip_frac"][1] == 4


def test_value_loss_gradient_hand_computed_and_against_the_written_out_formula():
    V, V_old, R, mask = value_case()
    V = V.clone().requires_grad_(True)
    loss, _ = value_loss(V, V_old, R, mask, 0.2, num_tokens=4)
    (g,) = torch.autograd.grad(loss, V)
    # d/dV 0.5 (V-R)^2 = V - R where that branch is the max (a, d); 0 where the clipped branch with V outside the
    # clip range is the max (b, c: V_c is constant there); / N_tok
    torch.testing.assert_close(g, torch.tensor([[-0.5, 0.0, 0.0], [0.9, 0.0, 0.0]]) / 4)
    # a random case against autograd of the formula written out token by token
    torch.manual_seed(0)
    V_old, R = torch.rand(4, 6), (torch.rand(4, 6) > 0.5).float()
    V = (V_old + 0.4 * torch.randn(4, 6)).requires_grad_(True)
    mask = torch.rand(4, 6) > 0.25
    loss, _ = value_loss(V, V_old, R, mask, 0.2, num_tokens=int(mask.sum()))
    (g,) = torch.autograd.grad(loss, V)
    ref = 0.0
    for i in range(4):
        for t in range(6):
            if mask[i, t]:
                v_c = V_old[i, t] + torch.clamp(V[i, t] - V_old[i, t], -0.2, 0.2)
                ref = ref + 0.5 * torch.maximum((V[i, t] - R[i, t]) ** 2, (v_c - R[i, t]) ** 2)
    ref = ref / mask.sum()
    (g_ref,) = torch.autograd.grad(ref, V)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(g, g_ref)


def test_value_loss_normalizer_independent_of_micro_batching_and_ranks():
    torch.manual_seed(1)
    B, T = 8, 5
    V_old, R = torch.rand(B, T), torch.rand(B, T)
    V = (V_old + 0.3 * torch.randn(B, T)).requires_grad_(True)
    mask = torch.rand(B, T) > 0.3
    n_tok = int(mask.sum())
    full, _ = value_loss(V, V_old, R, mask, 0.2, n_tok)
    (g_full,) = torch.autograd.grad(full, V)
    for world_size, micro in [(1, [[0, 1, 2], [3], [4, 5, 6, 7]]), (2, [[0, 1], [2, 3]]), (4, [[0], [1]])]:
        per_rank, total, grad = B // world_size, 0.0, torch.zeros_like(V)
        for r in range(world_size):  # each rank's loss times world_size; FSDP then averages over ranks
            for mb in micro:
                idx = [r * per_rank + i for i in mb]
                loss, _ = value_loss(V[idx], V_old[idx], R[idx], mask[idx], 0.2, n_tok)
                (g,) = torch.autograd.grad(loss * world_size, V)
                total += loss.item()
                grad += g / world_size
        assert total == pytest.approx(full.item(), abs=1e-6)
        torch.testing.assert_close(grad, g_full)


def test_policy_loss_on_per_token_advantages_gradient_against_the_written_out_formula():
    torch.manual_seed(0)
    B, T, L_max, eps_low, eps_high = 3, 4, 6, 0.2, 0.28
    old = -torch.rand(B, T) * 2
    logp = (old + 0.4 * torch.randn(B, T)).requires_grad_(True)
    adv = torch.randn(B, T)  # per token, both signs
    w = torch.rand(B, T) + 0.5
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = policy_loss(logp, old, adv, w, mask, eps_low, eps_high, L_max, B)
    (g,) = torch.autograd.grad(loss, logp)
    ref = 0.0
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                r = torch.exp(logp[i, t] - old[i, t])
                l_it = -torch.minimum(r * adv[i, t], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i, t])
                ref = ref + w[i, t] * l_it / L_max
    ref = ref / B
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(g, g_ref)
    # closed form: -w r A / (L_max N) where the unclipped branch is the min, 0 where the clip is active
    r = torch.exp(logp.detach() - old)
    clipped = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
    torch.testing.assert_close(g, -w * r * adv * (~clipped & mask) / L_max / B)
    assert stats["policy/clip_frac"][0] == (clipped & mask).sum().item() and stats["policy/clip_frac"][1] == mask.sum().item()


def test_policy_loss_with_a_broadcast_advantage_is_grpos():
    """The same function as grpo.py's: a per-sequence advantage broadcast over tokens gives grpo.py's loss."""
    from grpo import policy_loss as grpo_policy_loss
    torch.manual_seed(0)
    old = -torch.rand(5, 4) * 2
    logp = old + 0.4 * torch.randn(5, 4)
    adv_B, w, mask = torch.randn(5), torch.rand(5, 4) + 0.5, torch.rand(5, 4) > 0.3
    ppo, _ = policy_loss(logp, old, adv_B[:, None].expand(5, 4), w, mask, 0.2, 0.28, 6, 5)
    grpo, _ = grpo_policy_loss(logp, old, adv_B, w, mask, 0.2, 0.28, 6, 5)
    assert ppo.item() == grpo.item()


# ----------------------------------------------------------------------------------------------------------------
# The critic wrapper

def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def test_critic_starts_from_the_policy_weights(tiny_model_dir, process_group):
    _, _, device = process_group
    policy = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=False)
    critic = load_critic(tiny_model_dir, torch.float32, device, gradient_checkpointing=False, seed=1)
    pol, cri = dict(policy.lm.named_parameters()), dict(critic.lm.named_parameters())
    assert pol.keys() == cri.keys()
    for name in pol:
        assert torch.equal(full(pol[name]), full(cri[name])), name
    assert full(critic.value_head.weight).shape == (1, critic.lm.config.hidden_size)


def test_critic_values_have_the_response_layout_in_fp32(tiny_model_dir, process_group):
    _, _, device = process_group
    critic = load_critic(tiny_model_dir, torch.float32, device, gradient_checkpointing=True, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    w, b = full(critic.value_head.weight), full(critic.value_head.bias)
    prompts, responses = [[4, 5, 13], [7, 8, 9, 10, 14]], [[6, 7, 1], [3, 1]]
    ids, attn, rmask = collate(prompts, responses, 0, device)
    values = critic(ids, attn, rmask)
    assert values.dtype == torch.float32 and values.shape == rmask.shape == (2, 3)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        hidden = hf.model(torch.tensor([p + r])).last_hidden_state[0]
        # V of response token t is read where token t is predicted: at position len(p) - 1 + t
        ref = hidden[len(p) - 1:len(p) + len(r) - 1] @ w[0] + b[0]
        torch.testing.assert_close(values[row, :len(r)], ref, atol=1e-5, rtol=1e-5)
        assert (values[row, len(r):] == 0).all()
    # in fp16 compute the values are still fp32 tensors (the head's product is taken in fp32), close to fp32's
    critic16 = load_critic(tiny_model_dir, torch.float16, device, gradient_checkpointing=False, seed=1)
    values16 = critic16(ids, attn, rmask)
    assert values16.dtype == torch.float32
    torch.testing.assert_close(values16, values.detach(), atol=2e-2, rtol=0)


def test_value_head_init_is_seeded_and_survives_a_checkpoint(tiny_model_dir, process_group, tmp_path):
    _, _, device = process_group
    h1, h2, h3 = init_value_head(64, seed=1), init_value_head(64, seed=1), init_value_head(64, seed=2)
    assert torch.equal(h1.weight, h2.weight) and not torch.equal(h1.weight, h3.weight)
    assert (h1.bias == 0).all() and h1.weight.std().item() == pytest.approx(1 / 65, rel=0.3)
    # a critic checkpoint's value_head.safetensors carries the value head exactly; load_critic takes it over the seed
    critic = load_critic(tiny_model_dir, torch.float32, device, gradient_checkpointing=False, seed=1)
    head = ValueHeadState(critic).state_dict()
    ckpt = str(tmp_path / "critic_ckpt")
    shutil.copytree(tiny_model_dir, ckpt)
    save_file(head, os.path.join(ckpt, "value_head.safetensors"))
    with open(os.path.join(ckpt, "trainer_state.json"), "w") as f:
        json.dump({"step": 1}, f)
    restored = load_critic(ckpt, torch.float32, device, gradient_checkpointing=False, seed=2)
    assert torch.equal(full(restored.value_head.weight), full(critic.value_head.weight))
    assert torch.equal(full(restored.value_head.bias), full(critic.value_head.bias))
    # an older ppo.py's checkpoint (the head as JSON lists in trainer_state.json) is read once, exactly
    os.remove(os.path.join(ckpt, "value_head.safetensors"))
    with open(os.path.join(ckpt, "trainer_state.json"), "w") as f:
        json.dump({"step": 1, "value_head": {k: v.tolist() for k, v in head.items()}}, f)
    restored = load_critic(ckpt, torch.float32, device, gradient_checkpointing=False, seed=2)
    assert torch.equal(full(restored.value_head.weight), full(critic.value_head.weight))
    assert torch.equal(full(restored.value_head.bias), full(critic.value_head.bias))


# ----------------------------------------------------------------------------------------------------------------
# End to end (CPU, the built-in task)

SMALL = ["--num-steps", "3", "--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2",
         "--micro-batch-tokens", "96", "--eval-every", "0", "--eval-k", "2", "--eval-max-problems", "8",
         "--save-every", "1", "--keep-last", "2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
CRITIC_KEYS = ["critic/value_loss", "critic/explained_variance", "critic/value_mean", "critic/return_mean",
               "critic/value_clip_frac", "critic/grad_norm", "critic/loss_scale", "critic/adv_std_raw"]


def run(cmd):
    # CPU runs (two ranks cannot share one GPU under NCCL); tests/test_gpu.py covers the GPU
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_ppo_under_torchrun_then_resume_continues_exactly(tmp_path):
    """Two ranks in fp16: finite metrics (the critic's too), a policy checkpoint that from_pretrained loads, and a
    --resume from step 2 whose step 3 repeats the uninterrupted run's step 3 (policy, critic, optimizers, loss
    scalers and RNG streams all restored)."""
    run_dir = str(tmp_path / "run")
    p = run(TORCHRUN + ["ppo.py", "--run-dir", run_dir, *SMALL, "--precision", "fp16"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["step"] for r in rows if "eval/eval/accuracy" in r] == [3]
    for r in steps:
        for key in ["train/loss", "mismatch/kl_k3", "optim/grad_norm", "policy/approx_kl", *CRITIC_KEYS]:
            assert math.isfinite(r[key]), (key, r[key])
        assert r["critic/loss_scale"] == 2.0 ** 16 and 0 <= r["critic/value_clip_frac"] <= 1
    # the policy: a Hugging Face model directory; the critic in its critic/ folder, saved and pruned with it
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_000002", "step_000003"]
    path = os.path.join(run_dir, "checkpoints", "step_000003")
    assert os.path.isfile(os.path.join(path, "critic", "model.safetensors"))
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert torch.isfinite(model(torch.tensor([tok.encode("12+3=")])).logits).all()
    with open(os.path.join(path, "critic", "trainer_state.json")) as f:
        state = json.load(f)
    head = load_file(os.path.join(path, "critic", "value_head.safetensors"))
    assert head["weight"].shape == (1, model.config.hidden_size) and state["scaler"]["scale"] > 0
    assert "value_head" not in state

    resumed = str(tmp_path / "resumed")
    p = run(TORCHRUN + ["ppo.py", "--run-dir", resumed, *SMALL, "--precision", "fp16",
                        "--resume", os.path.join(run_dir, "checkpoints", "step_000002")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[resume]" in p.stdout and "step 2" in p.stdout
    again = [r for r in read_metrics(resumed) if "train/accuracy" in r]
    assert [r["step"] for r in again] == [3]
    for key in ["train/accuracy", "train/loss", "policy/approx_kl", "optim/grad_norm", *CRITIC_KEYS]:
        assert again[0][key] == pytest.approx(steps[2][key], rel=1e-5, abs=1e-7), key


def test_ppo_cpu_offload_changes_nothing_on_cpu(tmp_path):
    """Two ranks, --cpu-offload for the policy and the critic (on a CPU the weights are already there): the same
    metrics, step for step, and the same critic value head in its checkpoint, as without."""
    keys = ["train/accuracy", "train/loss", "policy/approx_kl", "optim/grad_norm", *CRITIC_KEYS]
    metrics, heads = {}, {}
    for name, extra in (("plain", []), ("offload", ["--cpu-offload"])):
        run_dir = str(tmp_path / name)
        p = run(TORCHRUN + ["ppo.py", "--run-dir", run_dir, *SMALL, "--num-steps", "2"] + extra)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        metrics[name] = [[r[k] for k in keys] for r in read_metrics(run_dir) if "train/accuracy" in r]
        heads[name] = load_file(os.path.join(run_dir, "checkpoints", "step_000002", "critic", "value_head.safetensors"))
    assert len(metrics["offload"]) == 2 and metrics["offload"] == metrics["plain"]
    assert all(torch.equal(heads["offload"][k], heads["plain"][k]) for k in ("weight", "bias"))


def test_resume_without_the_critic_checkpoint_fails_clearly(tmp_path):
    """A checkpoint without critic/ (an older ppo.py kept the critic in critic_checkpoints/): one line, exit 2."""
    from conftest import make_tiny_model_dir
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_000001"  # the policy's part as it was: a model directory + its state
    make_tiny_model_dir(str(step))
    (step / "trainer_state.json").write_text('{"step": 1}')
    p = run([sys.executable, "ppo.py", "--run-dir", str(run_dir), "--resume", "latest"])
    assert p.returncode == 2
    assert "critic_checkpoints" in p.stderr and "not a complete checkpoint" in p.stderr, p.stderr[-2000:]
    assert "Loading weights" not in p.stderr


@pytest.mark.parametrize("tie", [True, False])
def test_resume_with_a_tied_or_untied_output_head(tmp_path, tie):
    """The critic never uses its lm_head: untied, that weight got no gradient, so AdamW kept no state for it, and the
    resume's fresh optimizer asked the checkpoint for one ("Missing key ... lm.lm_head.weight.step"). Tied, the head
    is the embedding, which the critic uses. Both resume."""
    from conftest import make_tiny_model_dir
    model = make_tiny_model_dir(str(tmp_path / "m"), tie=tie)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    args = ["ppo.py", "--model", model, "--dataset", str(data), "--run-dir", str(tmp_path / "run"),
            "--prompt-template", "{problem}", "--reward", "exact", "--max-prompt-len", "16", "--max-response-len", "4",
            "--precision", "fp32", "--no-gradient-checkpointing", "--num-prompts", "4", "--group-size", "2",
            "--num-minibatches", "1", "--eval-every", "0", "--save-every", "1", "--keep-last", "0", "--lr", "1e-3"]
    p = run([sys.executable, *args, "--num-steps", "1"])
    assert p.returncode == 0, p.stderr[-3000:]
    p = run([sys.executable, *args, "--num-steps", "2", "--resume", "latest"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "train/accuracy" in r] == [1, 2]

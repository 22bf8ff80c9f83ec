"""--kl-coef: the KL penalty to the frozen reference policy (the run's starting weights). The k3 term of grpo.py and
its siblings against a hand computation (value and gradient) and under each script's own normalizer; ppo.py's
per-token penalty in the reward before GAE by hand; then every algorithm script (conftest.SCRIPTS) run for 2 steps
with --kl-coef in one process (tests/wiring.py each), step 2's recompute skipped as --exact skips it: kl_ref/* logged
and finite, 0 on step 1 (pi_old is the reference), the reference's forward on every step, loaded once, and never
with --kl-coef 0; a resume from step 1's checkpoint logs step 2's kl_ref/* as the uninterrupted run (the reference
is the starting weights, not the checkpoint's, and the policy's updates never reach it)."""
import importlib
import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
SMALL = ("--num-steps 2 --num-prompts 8 --group-size 4 --num-minibatches 2 --eval-every 0 --eval-max-problems 8 "
         "--save-every 0 --seed 5")
LN2, LN3 = math.log(2), math.log(3)
# d = ref_logp - logp of the hand-computed tokens: row 0 has three, row 1 one (then padding, off the mask)
D_BT = torch.tensor([[LN2, -LN2, 0.0], [LN3, 0.0, 0.0]])
MASK_BT = torch.tensor([[True, True, True], [True, False, False]])


def k3(d):  # exp(d) - d - 1, by hand
    return math.exp(d) - d - 1


def module(script):
    return importlib.import_module(script[:-len(".py")])


LOSS_SCRIPTS = [s for s in SCRIPTS if hasattr(module(s), "kl_k3")]  # the KL in the loss; ppo.py: in the reward


def test_every_script_has_the_kl_term():
    """In the loss (kl_k3) or, ppo.py, in the reward (kl_rewards); and the flag, default 0 (the study has no KL)."""
    for script in SCRIPTS:
        mod = module(script)
        assert hasattr(mod, "kl_k3") != hasattr(mod, "kl_rewards"), script
        assert mod.Args.kl_coef == 0.0, script
    assert "grpo.py" in LOSS_SCRIPTS and "ppo.py" not in LOSS_SCRIPTS


@pytest.mark.parametrize("value", ["-0.1", "nan", "inf"])
def test_a_kl_coef_below_0_or_not_finite_is_refused(value):
    """One line naming the flag (exit 2 through common/exits.py), before any model loads; in every script."""
    for script in SCRIPTS:
        mod = module(script)
        with pytest.raises(ValueError, match=f"^--kl-coef {value}: must be finite and >= 0"):
            mod.validate(mod.parse_args(["--kl-coef", value]), 1)


@pytest.mark.parametrize("script", LOSS_SCRIPTS)
def test_k3_value_and_gradient_by_hand(script):
    """k3 = exp(d) - d - 1, d = ref - logp: 1 - ln 2 at d = ln 2, ln 2 - 1/2 at -ln 2, 0 at 0; its gradient in logp
    1 - exp(d): -1, 1/2, 0. Past verl's bounds (d clamped to 20, k3 to 10) the value is 10 and the gradient 0."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0], requires_grad=True)
    ref = logp.detach() + torch.tensor([LN2, -LN2, 0.0, 25.0])
    out = module(script).kl_k3(logp, ref)
    assert out.tolist() == pytest.approx([1 - LN2, LN2 - 0.5, 0.0, 10.0], abs=1e-6)
    out.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, 0.5, 0.0, 0.0], abs=1e-6)


def loss_args(script, logp_BT, ref_BT, kl_coef):
    """policy_loss's arguments by name, those of its signature: A = 0 so that the policy term is 0 and the loss is
    the KL term alone; L_max 4, N_seq 5, N_tok 7 (numbers unlike the batch's, so a normalizer left out shows)."""
    values = {"logp_BT": logp_BT, "old_logp_BT": logp_BT.detach(), "mu_logp_BT": logp_BT.detach(),
              "adv_B": torch.zeros(2), "adv_BT": torch.zeros(2, 3), "weight_BT": torch.full((2, 3), 0.5),
              "mask_BT": MASK_BT, "eps_low": 0.2, "eps_high": 0.28, "max_response_len": 4, "num_seqs": 5,
              "num_tokens": 7.0, "is_mode": "is", "threshold": 3.0, "ref_logp_BT": ref_BT, "kl_coef": kl_coef}
    return {name: values[name] for name in inspect.signature(module(script).policy_loss).parameters}


# the KL term of each script's loss, by hand from D_BT (beta = 1): k3 summed over the tokens under its normalizer
K3_ROWS = [k3(LN2) + k3(-LN2) + k3(0.0), k3(LN3)]
BY_HAND = {"grpo.py": sum(K3_ROWS) / 4 / 5, "pg_is.py": sum(K3_ROWS) / 4 / 5,  # / L_max / N_seq
           "cispo.py": sum(K3_ROWS) / 7,  # / N_tok
           "gspo.py": (K3_ROWS[0] / 3 + K3_ROWS[1] / 1) / 5}  # a mean over each sequence's tokens, / N_seq


@pytest.mark.parametrize("script", LOSS_SCRIPTS)
def test_the_k3_term_enters_the_loss_under_the_scripts_normalizer(script):
    """beta = 0.5: the loss is 0.5 x BY_HAND (the rollout correction's weight 0.5 does not touch it); beta = 0 with a
    reference is the loss without one, value and gradient."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -7.0, -9.0]])
    ref = logp + D_BT
    loss_fn = module(script).policy_loss
    lp = logp.clone().requires_grad_(True)
    loss = loss_fn(**loss_args(script, lp, ref, 0.5))[0]
    assert loss.item() == pytest.approx(0.5 * BY_HAND[script], rel=1e-6)
    without = logp.clone().requires_grad_(True)
    zero = logp.clone().requires_grad_(True)
    a, b = loss_fn(**loss_args(script, without, None, 0.0))[0], loss_fn(**loss_args(script, zero, ref, 0.0))[0]
    a.backward()
    b.backward()
    assert b.item() == a.item() and torch.equal(zero.grad, without.grad)


def test_ppo_kl_penalty_in_the_reward_before_gae():
    """-beta (old - ref) on every response token, the terminal reward on the last: with gamma = lam = 1, A_t is the
    sum of the rewards from t on minus V_t, and R_t = A_t + V_t. Row 0: 3 tokens, row 1: 1 token (then padding)."""
    from ppo import gae_advantages, kl_rewards
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.25], [-2.0, -5.0, -5.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    kl_BT = kl_rewards(old, ref, mask, 0.5)
    torch.testing.assert_close(kl_BT, torch.tensor([[-0.25, 0.0, 0.125], [0.5, 0.0, 0.0]]))  # 0 off the mask
    values = torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.0, 0.0]])
    adv, ret = gae_advantages(torch.tensor([1.0, 0.0]), values, mask, 1.0, 1.0, kl_BT)
    torch.testing.assert_close(adv, torch.tensor([[-0.25 + 0 + 1.125 - 0.5, 1.125 - 0.25, 1.125 - 0.1],
                                                  [0.5 - 0.2, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.875, 1.125, 1.125], [0.5, 0.0, 0.0]]))
    plain = gae_advantages(torch.tensor([1.0, 0.0]), values, mask, 1.0, 1.0)
    with_zero = gae_advantages(torch.tensor([1.0, 0.0]), values, mask, 1.0, 1.0, kl_rewards(old, ref, mask, 0.0))
    assert all(torch.equal(x, y) for x, y in zip(plain, with_zero))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every script with --kl-coef 0.5 (grpo.py saving each step), grpo.py with --kl-coef 0, and grpo.py resumed from
    the first run's step-1 checkpoint: one process (tests/wiring.py each), about 30 s on 2 CPU cores."""
    d = tmp_path_factory.mktemp("kl_ref")
    cmds = [f"{s} --run-dir {d / s[:-3]} {SMALL} --kl-coef 0.5" + (" --save-every 1 --keep-last 0" if s == "grpo.py"
                                                                    else "") for s in SCRIPTS]
    cmds += [f"grpo.py --run-dir {d / 'beta0'} {SMALL} --kl-coef 0",
             f"grpo.py --run-dir {d / 'resumed'} {SMALL} --kl-coef 0.5 --resume "
             f"{d / 'grpo' / 'checkpoints' / 'step_000001'}"]
    p = subprocess.run([sys.executable, "tests/wiring.py", "each", str(d / "calls.json"), *cmds], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(d / "calls.json") as f:
        calls = json.load(f)

    def rows(name):
        with open(d / name / "metrics.jsonl") as f:
            return [r for r in map(json.loads, f) if "train/accuracy" in r]
    return calls, rows


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_logs_kl_ref_and_runs_the_reference_every_step(runs, script):
    """kl_ref/kl_k3 and kl_ref/kl_k1 every step, finite; exactly 0 on step 1, where pi_old is the starting weights as
    the reference is (same forward, same micro-batches), and k3 > 0 on step 2; the reference loaded once, and its
    forward over all the batch's micro-batches on step 2 too, where the recompute was skipped (0 micro-batches)."""
    calls, rows = runs
    call = calls[SCRIPTS.index(script)]
    steps = rows(script[:-3])
    assert len(steps) == 2 and call["reference_loads"] == 1
    for r in steps:
        assert math.isfinite(r["kl_ref/kl_k3"]) and math.isfinite(r["kl_ref/kl_k1"]), r
    assert steps[0]["kl_ref/kl_k3"] == 0.0 and steps[0]["kl_ref/kl_k1"] == 0.0
    assert steps[1]["kl_ref/kl_k3"] > 0
    (old1, n1), (ref1, m1), (old2, n2), (ref2, m2) = call["forwards"]
    assert (old1, ref1, old2, ref2) == ("old", "ref", "old", "ref")
    assert n1 == m1 > 0 and n2 == 0 and m2 > 0


def test_kl_coef_0_loads_no_reference_and_logs_no_kl_ref(runs):
    calls, rows = runs
    call = calls[len(SCRIPTS)]
    assert "--kl-coef 0" in call["run"] and call["reference_loads"] == 0
    assert [f[0] for f in call["forwards"]] == ["old", "old"]  # no reference forward
    assert not any(k.startswith("kl_ref/") for r in rows("beta0") for k in r)


def test_the_reference_is_the_starting_weights_not_the_resumed_checkpoint(runs):
    """Resumed from step 1's checkpoint, step 2 logs the uninterrupted run's kl_ref/*: the reference is the starting
    weights again (were it the checkpoint, the policy that sampled step 2, k3 would be about 0), and the policy's
    step-1 update never reached it in the uninterrupted run (else its step-2 k3 would be 0 too)."""
    calls, rows = runs
    assert "--resume" in calls[-1]["run"] and calls[-1]["reference_loads"] == 1
    first, resumed = rows("grpo"), rows("resumed")
    assert [r["step"] for r in resumed] == [2]
    assert first[1]["kl_ref/kl_k3"] > 1e-4
    for key in ("kl_ref/kl_k3", "kl_ref/kl_k1"):
        assert resumed[0][key] == first[1][key], key


def test_the_reference_is_frozen_and_held_in_the_train_precision(tiny_model_dir, process_group):
    """load_reference: no parameter needs a gradient, eval mode, its shards kept in the compute precision (bf16 here:
    half the bytes of the policy's fp32 masters), and the same log-probs as the policy loaded from the same weights
    computing in that precision (each rounds the file's fp32 weights to bf16 once: the same bits)."""
    from common.fsdp import load_policy, load_reference
    from common.logprobs import collate
    _, _, device = process_group
    ref = load_reference(tiny_model_dir, torch.bfloat16, device)
    policy = load_policy(tiny_model_dir, torch.bfloat16, device, gradient_checkpointing=False)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    rows = collate([[3, 4, 5], [6, 7]], [[8, 9, 10], [11]], 0, device)
    with torch.no_grad():
        want, _ = policy(*rows, 1.0, 2048)
        got, _ = ref(*rows, 1.0, 2048)
    assert torch.equal(got, want) and torch.isfinite(got).all()

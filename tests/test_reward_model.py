"""The learned reward (--reward-model; docs/reward-models.md): Bradley-Terry training, the reward model's inputs and
scores, Reward with a reward model (statistics, failures, normalization over ranks, its state), bad input refused
before training, and grpo.py / ppo.py against a reward model on the built-in task."""
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
from safetensors.torch import load_file, save_file

from common.metrics import StepStats
from tasks.rewards import Reward, RewardModelFlags, exact_match_reward
from reward_model import (Learned, LearnedReward, RewardModel, RunningMeanStd, check_reward_model, rm_input_ids,
                          sequence_scores)
from tasks.reward_model import (accumulate_gradients, bradley_terry_loss, encode_pairs, read_pairs, split_by_prompt,
                                 train_reward_model)
from conftest import SCRIPTS, assert_close_to_rounding, fp32_rounding_bound
from early_exit import early_exits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
CPU = torch.device("cpu")


def sum_pairs(n: int, seed: int) -> list[dict]:
    """n pairs of the built-in task's kind: a right sum chosen, the same sum with its last digit changed rejected."""
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        right = str(a + b)
        wrong = right[:-1] + rng.choice([d for d in "0123456789" if d != right[-1]])
        out.append({"prompt": f"{a}+{b}=", "chosen": right, "rejected": wrong})
    return out


@pytest.fixture(scope="session")
def small_rm(tmp_path_factory, tiny_model_dir):
    """A reward model trained for a few steps from the tests' tiny random causal LM: its scores are arbitrary, its
    format and head are what the scripts load."""
    out = str(tmp_path_factory.mktemp("rm") / "small")
    info = train_reward_model(tiny_model_dir, sum_pairs(64, 0), sum_pairs(16, 1), out, fmt="raw", epochs=1,
                              batch_size=16, lr=1e-3, log_every=1000, device="cpu")
    return out, info


@pytest.fixture(scope="session")
def builtin_rm(tmp_path_factory):
    """A reward model of the built-in task trained for 150 steps (the built-in recipe's takes a minute): sums against
    wrong sums of every kind, with the next-token loss. Returns (directory, its reward_model.json, held-out pairs)."""
    import random

    from tasks.builtin import ensure_builtin_task
    from tasks.reward_model import sum_pairs
    rng = random.Random(0)
    every_kind = (1, 1, 1, 1, 1)
    train, held = sum_pairs(150 * 64, rng, 100, every_kind, set()), sum_pairs(400, rng, 100, every_kind, set())
    out = str(tmp_path_factory.mktemp("rm") / "builtin_small")
    info = train_reward_model(ensure_builtin_task()["model"], train, held, out, fmt="raw", batch_size=64, lr=1e-3,
                              lm_coef=1.0, log_every=1000, device="cpu")
    return out, info, len(held)


def flags(path, **kw):
    return RewardModelFlags(reward_model=path, **kw)


def step_reward(rule, truncated, flags, probe=()):
    """Reward as the scripts build it (reward_model.check_run: the flags checked, then Reward loads the model), on the
    CPU in fp32, with the raw prompt template."""
    learned = Learned(flags, check_reward_model(flags, "{problem}")) if flags.reward_model else None
    return Reward(rule, truncated, None, CPU, False, learned, "{problem}", "fp32", probe=probe)


def score(reward, problems, responses, answers, finished):
    """Reward.score into a fresh StepStats: (rewards, correct, failures, the step's metrics)."""
    stats = StepStats(CPU)
    rewards, correct, failures = reward.score(stats, problems, responses, answers, finished)
    return rewards, correct, failures, stats.reduce()


# ---------------------------------------------------------------------------------------------------------------
# Bradley-Terry


def test_bradley_terry_loss_values_and_gradient():
    """-log sigmoid(d): log 2 at d = 0, finite and ~|d| far on the wrong side (no overflow), and its gradient in
    r_chosen is -sigmoid(-d)."""
    rc = torch.tensor([0.0, 2.0, -1000.0, 1000.0], requires_grad=True)
    rr = torch.tensor([0.0, 1.0, 0.0, 0.0])
    loss = bradley_terry_loss(rc, rr)
    d = (rc - rr).detach()
    torch.testing.assert_close(loss[:2].detach(), torch.log1p(torch.exp(-d[:2])))
    assert loss[2].item() == pytest.approx(1000.0) and loss[3].item() == pytest.approx(0.0, abs=1e-30)
    loss.sum().backward()
    torch.testing.assert_close(rc.grad, -torch.sigmoid(-d))


def test_the_gradient_does_not_depend_on_the_micro_batches(tiny_model_dir):
    """One optimizer step's gradient (Bradley-Terry and next-token loss) is the batch's: the pairs in one forward,
    in uneven micro-batches (pairs of several lengths) or one a forward give it up to fp32 rounding. Averaged per
    micro-batch instead, one pair a forward gave 6 times the gradient of one forward, and the uneven cut another
    direction."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1) * k}
             for a, b, k in ((1, 2, 1), (47, 38, 2), (5, 60, 3), (99, 99, 1), (3, 40, 4), (12, 7, 2))]
    encoded, skipped, same = encode_pairs(tok, pairs, "raw", 64)
    assert len(encoded) == 6 and skipped == same == 0
    grads = []
    for budget in (10 ** 6, 30, 1):  # all at once; unevenly; one pair a forward
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
        loss_sum, right = accumulate_gradients(model, encoded, list(range(6)), budget, 0, CPU, None,
                                               model.get_input_embeddings().weight, lm_coef=1.0)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert loss_sum > 0 and 0 <= right <= 6
    L = max(len(c) for c, r, *_ in encoded for c in (c, r))
    bound = fp32_rounding_bound(model.config, L, 2 * 6 * L, backward=True)
    for g in grads[1:]:
        assert_close_to_rounding(g, grads[0], bound)


def test_margins_and_centering_enter_the_loss(tiny_model_dir, tmp_path):
    """TRL's two additions to the Bradley-Terry loss: a pair's `margin` field (-log sigmoid(r_c - r_r - margin); 0
    where a row has none) and center_rewards_coefficient c (+ c (r_c + r_r)^2), averaged over the pairs. The gradient
    accumulated in micro-batches is that of this loss written out over the whole batch, and not that of the loss
    without them; a margin that is not a number is refused in one line."""
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tasks.reward_model import pair_scores
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "4", "margin": 2.5},
            {"prompt": "47+38=", "chosen": "85", "rejected": "86"},
            {"prompt": "5+60=", "chosen": "65", "rejected": "56", "margin": -1}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = read_pairs(str(path))
    assert [p["margin"] for p in pairs] == [2.5, 0.0, -1.0]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoded, _, _ = encode_pairs(tok, pairs, "raw", 64)
    coef, batch = 0.3, [0, 1, 2]

    def gradient(accumulate):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
        accumulate(model)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    def written_out(model):
        rc, rr, _ = pair_scores(model, encoded, batch, 0, CPU, None)
        margin = torch.tensor([2.5, 0.0, -1.0])
        (-F.logsigmoid(rc - rr - margin) + coef * (rc + rr) ** 2).mean().backward()

    ours = gradient(lambda m: accumulate_gradients(m, encoded, batch, 12, 0, CPU, None, center_coef=coef))
    want = gradient(written_out)
    no_margins = [e[:3] + (0.0,) for e in encoded]
    L = max(len(x) for c, r, *_ in encoded for x in (c, r))
    cfg = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).config
    bound = fp32_rounding_bound(cfg, L, 2 * 3 * L, backward=True)
    assert_close_to_rounding(ours, want, bound)
    for enc, c in ((no_margins, coef), (encoded, 0.0)):  # the test sees a term left out
        other = gradient(lambda m: accumulate_gradients(m, enc, batch, 12, 0, CPU, None, center_coef=c))
        assert (other - want).abs().max() > 100 * bound * want.abs().max()
    path.write_text(json.dumps({**rows[0], "margin": "big"}) + "\n")
    with pytest.raises(ValueError, match="line 1: field 'margin' is \"big\", not a finite number"):
        read_pairs(str(path))


def test_split_by_prompt_keeps_a_prompts_pairs_together():
    pairs = [{"prompt": f"p{i % 10}", "chosen": "a", "rejected": str(i)} for i in range(100)]
    train, held = split_by_prompt(pairs, 0.2, seed=3)
    assert len(train) + len(held) == 100 and len({p["prompt"] for p in held}) == 2
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}


def test_training_on_sums_beats_chance(builtin_rm):
    """A reward model trained here from the built-in model (a few seconds of the built-in recipe's kind of pairs)
    ranks held-out pairs better than chance: its held-out accuracy exceeds 1/2 by more than 4 standard deviations of
    a coin's (sqrt(1/4n)) and rose from where it started; the directory is one the scripts load."""
    path, info, n_held = builtin_rm
    assert info["eval_pairs"] == n_held
    assert info["eval_accuracy"] > 0.5 + 4 * math.sqrt(0.25 / n_held), info
    assert info["eval_accuracy"] > info["eval_accuracy_before"], info
    for name in ("config.json", "model.safetensors", "tokenizer.json", "reward_model.json"):
        assert os.path.isfile(os.path.join(path, name))
    assert check_reward_model(flags(path), "{problem}") == "raw"


# ---------------------------------------------------------------------------------------------------------------
# inputs and scores


def test_raw_and_chat_inputs(small_rm):
    path, _ = small_rm
    rm = RewardModel(path, "raw", "fp32", CPU, 4096)
    tok = rm.tokenizer
    assert rm_input_ids(tok, "12+3=", "15", "raw") == tok.encode("12+3=15") + [tok.eos_token_id]
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }}{% endfor %}"
    assert rm_input_ids(tok, "12+3=", "15", "chat") == tok.encode("u=12+3=a=15")


def test_scores_do_not_depend_on_batching_and_match_transformers(small_rm):
    """One sequence a forward, or all in one right-padded forward: the same scores within fp32 rounding; and
    transformers' own forward of a single unpadded sequence (its pooling reads the last token when no pad is in the
    row) gives them too."""
    path, _ = small_rm
    texts = [("1+1=", "2"), ("47+38=", "85"), ("9+90=", "99"), ("3+4=", "8"), ("10+10=", "2000")]
    one = RewardModel(path, "raw", "fp32", CPU, 1)
    many = RewardModel(path, "raw", "fp32", CPU, 10 ** 6)
    a = torch.tensor(one.score(*zip(*texts)))
    b = torch.tensor(many.score(*zip(*texts)))
    cfg = many.model.config
    L = max(len(many.tokenizer.encode(p + r)) + 1 for p, r in texts)
    bound = fp32_rounding_bound(cfg, L, L, backward=False)
    assert (a - b).abs().max() <= bound * b.abs().max()
    for (p, r), s in zip(texts, b):
        ids = torch.tensor([rm_input_ids(many.tokenizer, p, r, "raw")])
        with torch.no_grad():
            hf = many.model(input_ids=ids).logits[0, 0]
        assert abs(hf.item() - s.item()) <= bound * b.abs().max()
    assert len(set(b.tolist())) == len(texts)  # the scores differ: the test would see a swapped row


@pytest.fixture()
def pad_is_eos_rm(small_rm, tmp_path):
    """The small reward model as a published one (no reward_model.json) whose pad token is its end-of-sequence token,
    as in many tokenizers (and TRL's default when a tokenizer has no pad token)."""
    from transformers import AutoTokenizer
    path, _ = small_rm
    out = str(tmp_path / "pad_is_eos")
    shutil.copytree(path, out)
    os.remove(os.path.join(out, "reward_model.json"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["pad_token_id"] = cfg["eos_token_id"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    tok = AutoTokenizer.from_pretrained(out)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(out)
    return out


TEXTS = [("1+1=", "2"), ("47+38=", "85"), ("9+90=", "99"), ("3+4=", "8"), ("10+10=", "2000")]


def test_a_published_model_whose_pad_is_eos_is_read_as_transformers_reads_it(pad_is_eos_rm):
    """A reward model not trained here is read where transformers' AutoModelForSequenceClassification reads it (and
    so where TRL trained it): the last token that is not the config's pad token, here the token before the
    end-of-sequence token. Its own forward over the same right-padded batch gives our scores; reading the last
    token instead (the end-of-sequence token) gives others."""
    rm = RewardModel(pad_is_eos_rm, "raw", "fp32", CPU, 10 ** 6)
    assert rm.score_token == "last_non_pad" and rm.skip_id == rm.tokenizer.eos_token_id
    assert "not its pad token, id 1 (transformers' rule)" in rm.describe()
    ours = torch.tensor(rm.score(*zip(*TEXTS)))
    seqs = [rm_input_ids(rm.tokenizer, p, r, "raw") for p, r in TEXTS]
    assert all(s[-1] == rm.tokenizer.eos_token_id for s in seqs)
    from reward_model import right_pad
    ids, mask = right_pad(seqs, rm.tokenizer.pad_token_id, CPU)
    with torch.no_grad():
        theirs = rm.model(input_ids=ids, attention_mask=mask).logits[:, 0]
        at_last = sequence_scores(rm.model, ids, mask)  # the end-of-sequence token
    L = max(len(s) for s in seqs)
    bound = fp32_rounding_bound(rm.model.config, L, L, backward=False) * theirs.abs().max()
    assert (ours - theirs).abs().max() <= bound
    assert (at_last - theirs).abs().max() > 100 * bound  # the test sees the other position


def test_a_model_trained_here_is_read_where_it_was_trained(small_rm, pad_is_eos_rm, tmp_path):
    """tasks/reward_model.py records in reward_model.json that it trains at the last token; a model with that record
    is read there even where its pad token is its end-of-sequence token (one trained before the record too); a
    record of another rule is refused in one line."""
    _, info = small_rm
    assert info["score_token"] == "last"
    out = str(tmp_path / "trained_here")
    shutil.copytree(pad_is_eos_rm, out)
    for record in ({"format": "raw", "score_token": "last"}, {"format": "raw"}):
        with open(os.path.join(out, "reward_model.json"), "w") as f:
            json.dump(record, f)
        rm = RewardModel(out, "raw", "fp32", CPU, 10 ** 6)
        assert rm.skip_id is None and "as it was trained" in rm.describe()
        for p, r in TEXTS:
            ids = torch.tensor([rm_input_ids(rm.tokenizer, p, r, "raw")])
            with torch.no_grad():
                want = sequence_scores(rm.model, ids, torch.ones_like(ids))
            assert rm.score([p], [r]) == pytest.approx(want.tolist(), rel=1e-5, abs=1e-6)
    with open(os.path.join(out, "reward_model.json"), "w") as f:
        json.dump({"format": "raw", "score_token": "first"}, f)
    with pytest.raises(ValueError, match="score_token is \"first\", not one of last, last_non_pad"):
        check_reward_model(flags(out), "{problem}")


def test_the_score_head_runs_in_fp32_under_autocast(small_rm):
    """The trainer's --precision bf16 runs the forward under bf16 autocast: the head's product is fp32 all the same
    (autocast alone would run F.linear in bf16 and round every score to 8 bits of mantissa)."""
    path, _ = small_rm
    rm = RewardModel(path, "raw", "fp32", CPU, 10 ** 6)
    from reward_model import right_pad
    ids, mask = right_pad([rm_input_ids(rm.tokenizer, p, r, "raw") for p, r in TEXTS], 0, CPU)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        score_B, hidden_BLH = sequence_scores(rm.model, ids, mask, return_hidden=True)
    assert score_B.dtype == torch.float32
    h_BH = hidden_BLH[torch.arange(len(TEXTS)), mask.sum(-1) - 1].float()
    want_B = h_BH @ rm.model.score.weight.float()[0]
    torch.testing.assert_close(score_B, want_B, rtol=1e-5, atol=1e-6)  # bf16 rounding is ~4e-3 of a score


def test_too_long_inputs_are_not_run(small_rm):
    path, _ = small_rm
    rm = RewardModel(path, "raw", "fp32", CPU, 4096)
    rm.max_len = 8
    scores = rm.score(["1+1=", "1+1="], ["2", "2" * 20])
    assert math.isfinite(scores[0]) and math.isnan(scores[1])


# ---------------------------------------------------------------------------------------------------------------
# Reward with a reward model


def test_rewards_use_the_score_and_log_its_statistics(small_rm, process_group):
    """The rewards are the reward model's scores of the finished responses (a cut one gets truncated_reward), the
    accuracy is the rule's, and the logged statistics are those of a direct call on the same texts."""
    path, _ = small_rm
    problems = ["1+1=", "1+1=", "47+38=", "47+38=", "9+9="]
    responses = ["2", "3", "85", "86", "1818"]
    answers = ["2", "2", "85", "85", "18"]
    finished = [True, True, True, True, False]
    reward = step_reward("exact", -0.5, flags(path))
    rewards, correct, failures, m = score(reward, problems, responses, answers, finished)
    direct = RewardModel(path, "raw", "fp32", CPU, 4096).score(problems[:4], responses[:4])
    assert rewards == direct + [min(direct + [-0.5])]
    assert correct == [exact_match_reward(r, a) * f for r, a, f in zip(responses, answers, finished)]
    assert failures == 0
    d = torch.tensor(direct, dtype=torch.float64)
    assert m["reward_model/score_mean"] == pytest.approx(d.mean().item(), rel=1e-12)
    assert m["reward_model/score_std"] == pytest.approx(d.std(unbiased=False).item(), rel=1e-9)
    assert (m["reward_model/score_min"], m["reward_model/score_max"]) == (min(direct), max(direct))
    assert "reward_model/running_mean" not in m and "reward_model/clip_frac" not in m


def test_a_step_with_no_finished_response(small_rm, process_group):
    """Every response cut at the length limit (a real model's first steps at a short limit): nothing to score, each
    gets truncated_reward, and the score statistics are NaN, not an error."""
    path, _ = small_rm
    reward = step_reward("exact", -1.0, flags(path, rm_normalize=True))
    rewards, correct, failures, m = score(reward, ["1+1="] * 2, ["2", "3"], ["2"] * 2, [False, False])
    assert rewards == [-1.0, -1.0] and correct == [0.0, 0.0] and failures == 0
    assert math.isnan(m["reward_model/score_mean"]) and math.isnan(m["reward_model/score_max"])


def test_rule_alone_is_unchanged(process_group):
    reward = step_reward("exact", 0.0, RewardModelFlags())
    rewards, correct, failures, m = score(reward, ["1+1="] * 3, ["2", "3", "2"], ["2"] * 3, [True, True, False])
    assert rewards == correct == [1.0, 0.0, 0.0] and failures == 0
    assert not any(k.startswith("reward_model/") for k in m) and reward.state_dict() == {}


@pytest.fixture()
def nan_rm(small_rm, tmp_path):
    """The small reward model with the embedding of the digit 9 made NaN: any input holding a 9 scores NaN."""
    path, _ = small_rm
    out = str(tmp_path / "nan_rm")
    shutil.copytree(path, out)
    weights = load_file(os.path.join(out, "model.safetensors"))
    tok = RewardModel(path, "raw", "fp32", CPU, 4096).tokenizer
    weights["model.embed_tokens.weight"][tok.convert_tokens_to_ids("9")] = float("nan")
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_nan_score_is_a_reward_failure(nan_rm, process_group):
    from common.precision import TrainingFault
    from tasks.rewards import check_step_rewards
    reward = step_reward("exact", 0.0, flags(nan_rm))
    rewards, correct, failures, m = score(reward, ["1+1=", "4+5=", "1+2="], ["2", "9", "3"], ["2", "9", "3"],
                                          [True, True, True])
    assert failures == 1 and rewards[1] == min(rewards[0], rewards[2], 0.0)
    assert all(math.isfinite(r) for r in rewards) and correct == [1.0, 1.0, 1.0]
    assert m["reward_model/score_mean"] == pytest.approx((rewards[0] + rewards[2]) / 2)
    every = score(reward, ["9+9="], ["18"], ["18"], [True])
    with pytest.raises(TrainingFault, match="every reward check"):
        check_step_rewards(1, every[2], 1, CPU)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_cut_or_failed_response_gets_the_steps_lowest_normalized_reward(nan_rm, process_group, clip, capfd):
    """With --rm-normalize a fixed --truncated-reward 0 is the running mean, no penalty: a cut response and one whose
    score failed (NaN: the digit 9) get the step's lowest reward instead, after normalization (and the clip), below
    the mean; a lower --truncated-reward is taken as it is; a step with nothing scored gets --truncated-reward."""
    problems, responses = ["1+1=", "4+5=", "1+2=", "47+38=", "1+1="], ["2", "9", "3", "85", "11111111"]
    finished = [True, True, True, True, False]
    rewards, _, failures, m = score(step_reward("exact", 0.0, flags(nan_rm, rm_normalize=True, rm_clip=clip)),
                                    problems, responses, ["2", "9", "3", "85", "2"], finished)
    said = "gets the step's lowest reward (normalized" + (" and clipped)" if clip else ")")
    assert said + ", or --truncated-reward 0 when that is lower" in capfd.readouterr().out  # at start
    scored = [rewards[i] for i in (0, 2, 3)]
    assert failures == 1 and rewards[1] == rewards[4] == min(scored) < 0
    assert len(set(scored)) == 3  # the scores differ: a penalty of the highest or the middle one would show
    rewards, _, _, _ = score(step_reward("exact", -5.0, flags(nan_rm, rm_normalize=True, rm_clip=clip)),
                             problems, responses, ["2", "9", "3", "85", "2"], finished)
    assert rewards[1] == rewards[4] == -5.0
    every_cut = score(step_reward("exact", -2.0, flags(nan_rm, rm_normalize=True)), ["1+1="], ["2"], ["2"], [False])
    assert every_cut[0] == [-2.0]


def test_a_nan_forward_is_refused_before_training(nan_rm):
    with pytest.raises(ValueError, match="its forward gives nan"):
        step_reward("exact", 0.0, flags(nan_rm),
                    probe=[{"problem": "4+5=", "answer": "9"}, {"problem": "1+1=", "answer": "2"}])


def test_normalize_and_clip(small_rm, process_group):
    """--rm-normalize: (s - mean) / sqrt(var + 1e-8) over every score so far, this step's included; --rm-clip
    after it; the running state goes through state_dict into a new Reward."""
    path, _ = small_rm
    reward = step_reward("exact", 0.0, flags(path, rm_normalize=True, rm_clip=1.0))
    texts = [("1+1=", "2"), ("47+38=", "85"), ("9+90=", "99"), ("3+4=", "8")]
    raw1 = RewardModel(path, "raw", "fp32", CPU, 4096).score(*zip(*texts))
    r1, _, _, m1 = score(reward, [p for p, _ in texts], [r for _, r in texts], ["0"] * 4, [True] * 4)
    all1 = torch.tensor(raw1, dtype=torch.float64)
    want = ((all1 - all1.mean()) / torch.sqrt(all1.var(unbiased=False) + 1e-8)).clamp(-1, 1)
    torch.testing.assert_close(torch.tensor(r1, dtype=torch.float64), want)
    clipped = ((all1 - all1.mean()) / all1.std(unbiased=False)).abs().gt(1).sum().item()
    assert 0 < clipped < 4 and m1["reward_model/clip_frac"] == clipped / 4
    assert m1["reward_model/running_mean"] == pytest.approx(all1.mean().item(), rel=1e-12)
    state = json.loads(json.dumps(reward.state_dict()))  # as trainer_state.json keeps it
    again = step_reward("exact", 0.0, flags(path, rm_normalize=True, rm_clip=1.0))
    again.load_state_dict(state)
    r2, r2_again = (score(r, [p for p, _ in texts[:2]], [x for _, x in texts[:2]], ["0"] * 2, [True] * 2)[0]
                    for r in (reward, again))
    assert r2 == r2_again
    both = torch.cat([all1, all1[:2]])
    want2 = ((all1[:2] - both.mean()) / torch.sqrt(both.var(unbiased=False) + 1e-8)).clamp(-1, 1)
    torch.testing.assert_close(torch.tensor(r2, dtype=torch.float64), want2)


def test_running_mean_std_merges_batches_exactly():
    torch.manual_seed(0)
    batches = [torch.randn(n, dtype=torch.float64) * 3 + 5 for n in (1, 7, 30, 2)]
    rms = RunningMeanStd()
    for b in batches:
        rms.update(len(b), b.sum().item(), (b * b).sum().item())
    everything = torch.cat(batches)
    assert rms.count == len(everything)
    assert rms.mean == pytest.approx(everything.mean().item(), rel=1e-12)
    assert rms.std == pytest.approx(everything.std(unbiased=False).item(), rel=1e-9)


class ListScorer:
    """A stand-in for RewardModel in the two-rank test below: it returns the float of each response text, so that
    each rank's scores are known exactly (the scoring itself is tested above)."""

    def score(self, prompts, responses):
        return [float(r) for r in responses]


def _normalize_on_rank(rank, port, values, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    reward = step_reward("exact", 0.0, RewardModelFlags())
    reward.learned = LearnedReward(ListScorer(), RewardModelFlags(reward_model="x", rm_normalize=True), 0.0, CPU,
                                   "{problem}")
    mine = values[rank] + [0.0]  # and a cut response, not scored
    rewards, _, _, m = score(reward, ["1+1="] * len(mine), [str(v) for v in mine], ["2"] * len(mine),
                             [True] * (len(mine) - 1) + [False])
    out[rank, :len(mine)] = torch.tensor(rewards, dtype=torch.float64)
    out[rank, 4:] = torch.tensor([m["reward_model/score_max"], m["reward_model/score_min"]], dtype=torch.float64)
    dist.destroy_process_group()


def test_normalization_statistics_are_global_over_ranks():
    """Two ranks with different numbers of scores each normalize by the mean and std of all of them, and log the
    maximum and minimum of all of them; a cut response on either rank gets the lowest normalized score of all (rank
    0's)."""
    values = [[1.0, 2.0], [3.0, 4.0, 10.0]]
    out = torch.zeros(2, 6, dtype=torch.float64).share_memory_()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_normalize_on_rank, args=(port, values, out), nprocs=2)
    every = torch.tensor(values[0] + values[1], dtype=torch.float64)
    want = (every - every.mean()) / torch.sqrt(every.var(unbiased=False) + 1e-8)
    torch.testing.assert_close(torch.cat([out[0, :2], out[1, :3]]), want)
    torch.testing.assert_close(torch.stack([out[0, 2], out[1, 3]]), want.min().expand(2))
    assert out[:, 4].tolist() == [10.0, 10.0] and out[:, 5].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------------------------
# bad input: refused with one line before training


def test_bad_reward_model_directories(tiny_model_dir, small_rm, tmp_path):
    path, _ = small_rm
    with pytest.raises(ValueError, match="no scalar head"):  # a causal LM
        check_reward_model(flags(tiny_model_dir), "{problem}")
    two = str(tmp_path / "two_labels")
    shutil.copytree(path, two)
    with open(os.path.join(two, "config.json")) as f:
        cfg = json.load(f)
    cfg["id2label"] = {"0": "bad", "1": "good"}
    with open(os.path.join(two, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="2 labels"):
        check_reward_model(flags(two), "{problem}")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        check_reward_model(flags(str(tmp_path / "missing")), "{problem}")
    # the prompts are chat turns: the reward model needs a chat template, and to have been trained on them
    with pytest.raises(ValueError, match="trained on 'raw' inputs"):
        check_reward_model(flags(path), "chat:{problem}")
    untold = str(tmp_path / "untold")
    shutil.copytree(path, untold)
    os.remove(os.path.join(untold, "reward_model.json"))  # a reward model from elsewhere: no record of its format
    with pytest.raises(ValueError, match="no chat template"):
        check_reward_model(flags(untold), "chat:{problem}")
    with pytest.raises(ValueError, match="--rm-normalize"):
        check_reward_model(RewardModelFlags(rm_normalize=True), "{problem}")
    with pytest.raises(ValueError, match="--rm-clip"):
        check_reward_model(flags(path, rm_clip=-1.0), "{problem}")


def rm_copy(src, dst, config=None, weights_as_pickle=False):
    """A copy of the reward model src, with its config.json replaced by `config` (any JSON) and, with
    weights_as_pickle, its weights as a torch.save pickle (pytorch_model.bin) instead of safetensors."""
    shutil.copytree(src, dst)
    if config is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    if weights_as_pickle:
        torch.save(load_file(os.path.join(dst, "model.safetensors")), os.path.join(dst, "pytorch_model.bin"))
        os.remove(os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("change, says", [
    (lambda cfg: dict(config=[cfg]), "config.json holds a JSON list, not an object"),
    (lambda cfg: dict(config={**cfg, "num_labels": [1]}), "num_labels is [1], not a whole number"),
    (lambda cfg: dict(config={**cfg, "id2label": ["score"]}), 'id2label is ["score"], not an object'),
    (lambda cfg: dict(config={**cfg, "architectures": "Qwen2ForSequenceClassification"}), "not a list of class names"),
    (lambda cfg: dict(weights_as_pickle=True), "pytorch_model.bin: pickled weights, not loaded"),
], ids=["config-list", "num_labels-list", "id2label-list", "architectures-string", "pickle-only"])
def test_reward_model_directories_of_the_wrong_shape(small_rm, tmp_path, change, says):
    """Valid JSON of the wrong shape, and weights that are a pickle: one line (a ValueError or FileNotFoundError,
    exit code 2 in a script), before anything loads."""
    path, _ = small_rm
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        check_reward_model(flags(rm_copy(path, str(tmp_path / "rm"), **change(cfg))), "{problem}")
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def openrlhf_copy(src, dst, architectures, normalize_reward=True, head="value_head"):
    """The reward model src saved as OpenRLHF saves one: its scalar head under `head`, its config naming
    `architectures` and holding normalize_reward (with the mean and std it divides by), no reward_model.json."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = architectures
    if normalize_reward:
        cfg.update(normalize_reward=True, mean=0.5, std=2.0)
    rm_copy(src, dst, config=cfg)
    os.remove(os.path.join(dst, "reward_model.json"))
    weights = load_file(os.path.join(dst, "model.safetensors"))
    weights[f"{head}.weight"] = weights.pop("score.weight")
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("architectures, normalize_reward, head, says", [
    (["Qwen2Model"], True, "value_head", "its head is value_head.weight"),
    (["RewardModel"], True, "score", "its config.json has normalize_reward and names RewardModel"),
    (["Qwen2ForSequenceClassification"], False, "value_head", "its head is value_head.weight"),
], ids=["value_head", "score-head-normalize", "classifier-config-value-head"])
def test_an_openrlhf_style_reward_model_is_refused_in_one_line(small_rm, tmp_path, architectures, normalize_reward,
                                                               head, says):
    """OpenRLHF saves its reward models with a value head (`value_head` by default) and normalize_reward in the
    config: one line that says so and what is read, before anything loads. With a classifier's config, transformers
    would load it with a new random `score` head and the run would train on noise."""
    path, _ = small_rm
    out = openrlhf_copy(path, str(tmp_path / "openrlhf"), architectures, normalize_reward, head)
    with pytest.raises(ValueError) as e:
        check_reward_model(flags(out), "{problem}")
    msg = str(e.value)
    assert "an OpenRLHF-style reward model" in msg and says in msg and "\n" not in msg, msg
    assert "...ForSequenceClassification with one label and its head named `score`" in msg


def test_a_script_refuses_a_reward_model_whose_config_is_a_list(small_rm, tmp_path):
    path, _ = small_rm
    with open(os.path.join(path, "config.json")) as f:
        bad = rm_copy(path, str(tmp_path / "listed"), config=[json.load(f)])
    p = subprocess.run([sys.executable, "grpo.py", "--run-dir", str(tmp_path / "run"), "--reward-model", bad],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert_one_line_error(p, "not an object")


def test_bad_pairs_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2"}\n')
    with pytest.raises(ValueError, match="'rejected' missing"):
        read_pairs(str(bad))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'.encode()
                       + '{"prompt": "caf\u00e9", "chosen": "2", "rejected": "3"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl: line 2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        read_pairs(str(latin1))


def test_pairs_are_read_as_datasets_are(tmp_path):
    """A pairs file is read by the datasets' reader (tasks/data.py): .json and .parquet as .jsonl, a bad row named."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.5}, {"prompt": "2+2=", "chosen": "4",
                                                                             "rejected": "5"}]
    want = [{**rows[0]}, {**rows[1], "margin": 0.0}]
    (tmp_path / "p.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist([{**r, "margin": r.get("margin", 0.0)} for r in rows]), tmp_path / "p.parquet")
    assert read_pairs(str(tmp_path / "p.json")) == want == read_pairs(str(tmp_path / "p.parquet"))
    (tmp_path / "bad.json").write_text(json.dumps([rows[0], {"prompt": "x", "chosen": 1, "rejected": "y"}]))
    with pytest.raises(ValueError, match=r"bad.json: row 1 \(0-based\): field 'chosen' missing or not a string"):
        read_pairs(str(tmp_path / "bad.json"))


def test_pairs_with_chosen_equal_to_rejected_are_dropped_and_counted(tiny_model_dir, tmp_path, capfd):
    """Such a pair teaches nothing and, held out, is a tie that counts as wrong: dropped, said at start and counted
    in reward_model.json; with nothing else left, refused."""
    same = [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}] * 3
    info = train_reward_model(tiny_model_dir, sum_pairs(8, 0) + same, sum_pairs(4, 1) + same[:1],
                              str(tmp_path / "rm"), fmt="raw", batch_size=8, log_every=1000, device="cpu")
    assert info["train_pairs"] == 8 and info["eval_pairs"] == 4 and info["identical_pairs_dropped"] == 4
    assert "dropped 3 training and 1 held-out pairs whose chosen and rejected" in capfd.readouterr().err
    with pytest.raises(ValueError, match="no training pair left: 0 longer than .*, 3 with chosen == rejected"):
        train_reward_model(tiny_model_dir, same, [], str(tmp_path / "rm2"), fmt="raw", device="cpu")


def test_the_trainer_refuses_a_base_with_a_two_label_head(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tasks.reward_model import Args, main
    base = str(tmp_path / "two_labels")
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2).save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in sum_pairs(4, 0)))
    with pytest.raises(ValueError, match="its head has 2 labels; a reward model has one"):
        main(Args(base=base, pairs=str(pairs), out_dir=str(tmp_path / "out")))
    assert not os.path.exists(tmp_path / "out")


def assert_one_line_error(p, message):
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr


@pytest.fixture(scope="module")
def causal_lm_as_reward_model(tiny_model_dir, tmp_path_factory):
    """{script: its result with a causal LM (the tiny model) as --reward-model}, all in one early_exits."""
    tmp = tmp_path_factory.mktemp("causal_lm_rm")
    results = early_exits([(script, ["--run-dir", str(tmp / f"run_{script[:-3]}"), "--reward-model", tiny_model_dir])
                           for script in SCRIPTS], str(tmp), ENV)
    return dict(zip(SCRIPTS, results))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_refuses_a_causal_lm_as_reward_model_before_a_model_loads(script, causal_lm_as_reward_model):
    p = causal_lm_as_reward_model[script]
    assert_one_line_error(p, "no scalar head")
    assert "[setup]" not in p.stdout and "[reward]" not in p.stdout


# ---------------------------------------------------------------------------------------------------------------
# the scripts against a reward model, on the built-in task


def run(args, nproc=1):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    p = subprocess.run(launcher + args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def steps_of(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "train/accuracy" in r}


def test_grpo_against_an_inverted_reward_model_unlearns_the_task(builtin_rm, tmp_path):
    """The learned reward is what trains: against the reward model with its head negated (it prefers wrong sums),
    grpo.py's true accuracy (the rule's, train/accuracy) falls while the score it is trained on rises; the
    reward_model/* keys are logged every step and the evaluation stays the rule's."""
    path, _, _ = builtin_rm
    inverted = str(tmp_path / "inverted")
    shutil.copytree(path, inverted)
    weights = load_file(os.path.join(inverted, "model.safetensors"))
    weights["score.weight"] = -weights["score.weight"]
    save_file(weights, os.path.join(inverted, "model.safetensors"), metadata={"format": "pt"})
    run_dir = str(tmp_path / "run")
    p = run(["grpo.py", "--run-dir", run_dir, "--reward-model", inverted, "--num-steps", "5", "--lr", "2e-3",
             "--eval-every", "0", "--eval-max-problems", "16", "--save-every", "0"])
    assert "[reward] learned reward" in p.stdout and "its tokenizer is the policy's" in p.stdout
    rows = steps_of(run_dir)
    # 512 responses a step: the standard deviation of an accuracy near 0.4 is sqrt(0.24 / 512) = 0.022; a fall of
    # 0.15 from step 1 (sampled before any update) to step 5 is 5 of those on either side
    assert rows[5]["train/accuracy"] < rows[1]["train/accuracy"] - 0.15, [rows[s]["train/accuracy"] for s in rows]
    assert rows[5]["reward_model/score_mean"] > rows[1]["reward_model/score_mean"]
    for r in rows.values():
        assert r["reward_model/score_min"] <= r["reward_model/score_mean"] <= r["reward_model/score_max"]
        assert r["reward_model/score_std"] >= 0 and r["time/reward"] > 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval/eval/accuracy" in r]
    assert evals and all(0 <= r["eval/eval/accuracy"] <= 1 for r in evals)


def test_ppo_with_normalization_resumes_exactly(builtin_rm, tmp_path):
    """ppo.py against the reward model with --rm-normalize and --rm-clip, under torchrun with 2 ranks: interrupted
    after step 2 and resumed, its step 3 is the uninterrupted run's (the running mean and std come back from
    trainer_state.json, where they count every scored response of steps 1-2 over both ranks)."""
    path, _, _ = builtin_rm
    args = ["ppo.py", "--reward-model", path, "--rm-normalize", "--rm-clip", "2", "--num-prompts", "16",
            "--group-size", "4", "--eval-every", "0", "--save-every", "1", "--keep-last", "0"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run(args + ["--run-dir", a, "--num-steps", "3"], nproc=2)
    step2 = os.path.join(a, "checkpoints", "step_000002")
    run(args + ["--run-dir", b, "--num-steps", "3", "--resume", step2], nproc=2)  # as if a had stopped after step 2
    ra, rb = steps_of(a), steps_of(b)
    keys = ["train/accuracy", "train/loss", "critic/value_loss", "reward_model/score_mean",
            "reward_model/running_mean", "reward_model/running_std", "reward_model/clip_frac"]
    assert [ra[3][k] for k in keys] == [rb[3][k] for k in keys]
    with open(os.path.join(step2, "trainer_state.json")) as f:
        running = json.load(f)["reward"]["running"]
    scored = sum(64 * (1 - ra[s]["train/truncated_frac"]) - ra[s]["train/reward_failures"] for s in (1, 2))
    assert running["count"] == pytest.approx(scored)
    assert running["mean"] == pytest.approx(ra[2]["reward_model/running_mean"])


def test_pairs_from_policy_samples_then_a_reward_model_from_the_command_line(tmp_path):
    """tasks/reward_pairs.py on the built-in policy: every pair is a right answer chosen over a wrong one of the same
    problem (the exact rule's verdicts), distinct; tasks/reward_model.py trains on them into a directory the scripts
    load, and refuses an existing one."""
    from tasks.builtin import ensure_builtin_task
    task = ensure_builtin_task()
    pairs = str(tmp_path / "pairs.jsonl")
    p = subprocess.run([sys.executable, "-m", "tasks.reward_pairs", "--model", task["model"], "--dataset",
                        task["train"], "--out", pairs, "--prompt-template", "{problem}", "--reward", "exact",
                        "--k", "4", "--max-problems", "64", "--max-response-len", "8", "--sampler", "hf",
                        "--precision", "fp32"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(pairs) as f:
        rows = [json.loads(line) for line in f]
    assert rows and len({r["problem"] for r in rows}) <= 64
    for r in rows:
        assert r["prompt"] == r["problem"] and r["chosen"] != r["rejected"]
        assert exact_match_reward(r["chosen"], r["answer"]) == 1 and exact_match_reward(r["rejected"], r["answer"]) == 0
    out = str(tmp_path / "rm")
    cmd = [sys.executable, "-m", "tasks.reward_model", "--base", task["model"], "--pairs", pairs, "--out-dir", out,
           "--lr", "1e-3", "--batch-size", "16", "--eval-frac", "0.2"]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "held-out pair accuracy" in p.stderr and check_reward_model(flags(out), "{problem}") == "raw"
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert_one_line_error(p, "exists")


def test_builtin_takes_no_other_flag():
    from tasks.reward_model import Args, main
    with pytest.raises(ValueError, match="--builtin takes no other flag.*--lr"):
        main(Args(builtin=True, lr=1e-3))


def _make(*args: str, dry: bool = True) -> subprocess.CompletedProcess:
    cmd = ["make", "-s", "-C", ROOT, *(["-n"] if dry else []), "VENV=/nonexistent", "PY=python3", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_real_model_targets_run_each_arm_with_its_flags():
    """make reward-model-real's runs (printed, not run: make -n): the learned reward's, the leash's at each
    REAL_RM_BETAS with its --kl-coef, the rule's without the reward model, all four in reward-model-real and on the
    plot; a RUN that is none of them stops with one line and exit 2 before anything runs."""
    runs = {run: _make("reward-model-real-run", f"RUN={run}") for run in ("rm", "kl0.1", "kl1", "rule")}
    for run, p in runs.items():
        assert p.returncode == 0, p.stderr
        line = " ".join(p.stdout.split())
        assert f"--run-dir runs/reward_model_real/grpo_{run} " in line
        assert ("--reward-model runs/reward_model_real/rm" in line) == (run != "rule")
        assert ("--kl-coef" in line) == run.startswith("kl")
    assert "--kl-coef 0.1 " in " ".join(runs["kl0.1"].stdout.split()) + " "
    whole = _make("reward-model-real", "REAL_RM_BETAS=0.5")
    assert whole.returncode == 0, whole.stderr
    assert all(f"--run-dir runs/reward_model_real/grpo_{run} " in whole.stdout for run in ("rm", "kl0.5", "rule"))
    assert '"reward model, beta 0.5"' in whole.stdout and "grpo_kl0.1" not in whole.stdout
    bad = _make("reward-model-real-run", "RUN=kl", dry=False)
    assert bad.returncode == 2 and "RUN=kl: one of rm kl0.1 kl1 rule" in bad.stdout

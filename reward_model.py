"""The learned reward (--reward-model; docs/reward-models.md): a reward model's scalar score of prompt + response.

A reward model is a Hugging Face directory of an AutoModelForSequenceClassification with one label, the usual format
of published reward models: a decoder LM (LlamaForSequenceClassification, Qwen2ForSequenceClassification, ...) whose
`score` head maps a final hidden state to one number. tasks/reward_model.py trains one from preference pairs
(Bradley-Terry). In RL each rank loads a whole copy on its device, in a precision of its own, and scores its own
responses, a token budget of sequences per forward; no collective.

What it reads is built from text with its own tokenizer, the same way when it is trained and when it scores
(rm_input_ids): the prompt as the policy's --prompt-template wrote it (the user turn of a chat template, or the raw
prompt: tasks.data.prompt_text) and the response decoded from the policy's tokens, then in format
  'chat'  its tokenizer's chat template around a user turn and an assistant turn, or
  'raw'   prompt + response + its end-of-sequence token.
A run's format follows its prompts: chat turns give 'chat', a raw template 'raw'. A reward model with another
tokenizer than the policy's thus needs nothing more than its own tokenizer (the run says which at start).

The score is read where the model was trained to be read (score_token): a reward model that tasks/reward_model.py
trained at the input's last token (the end of the assistant turn, or the end-of-sequence token), as its
reward_model.json records; any other (a published one, TRL's) by transformers' rule, the last token that is not its
config's pad token (AutoModelForSequenceClassification's forward): where pad and end-of-sequence are one token, the
token before the end-of-sequence token.
"""
import json
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tasks.data import is_chat, prompt_text
from common.dist import print0, reduce_stats
from common.logprobs import split_microbatches
from common.precision import DTYPES
from common.preflight import check_model_dir
from tasks.rewards import RewardModelFlags, check_reward_flags

INFO_FILE = "reward_model.json"  # written by tasks/reward_model.py beside the weights: the format it was trained on
# where a score is read (score_token): "last", the input's last token (tasks/reward_model.py trains there);
# "last_non_pad", transformers' rule for ...ForSequenceClassification, the last token that is not the config's pad token
SCORE_TOKENS = ("last", "last_non_pad")


def check_reward_model(flags: RewardModelFlags, prompt_template: str) -> str | None:
    """Everything about --reward-model that can be checked before a model loads; raises a one-line ValueError or
    FileNotFoundError. Returns the input format the run will use ('chat' or 'raw'), None without a reward model."""
    path = flags.reward_model
    if path is None:
        check_reward_flags(flags)
        return None
    if flags.rm_batch_tokens < 1:
        raise ValueError(f"--rm-batch-tokens {flags.rm_batch_tokens}: must be at least 1")
    if not (math.isfinite(flags.rm_clip) and flags.rm_clip >= 0):
        raise ValueError(f"--rm-clip {flags.rm_clip}: must be finite and >= 0 (0: no clip)")
    where = f"--reward-model {path!r}"
    path = os.path.expanduser(path)  # (a quoted ~ reaches here as it is: config.json then names no home directory)
    check_model_dir(path, "--reward-model")  # the directory, config.json, tokenizer, JSON files, weights complete
    config = read_config(path, where)
    openrlhf = openrlhf_style(config, weight_names(path))
    if openrlhf:
        raise ValueError(f"{where}: an OpenRLHF-style reward model ({openrlhf}), not read here: --reward-model reads a "
                         "transformers ...ForSequenceClassification with one label and its head named `score`, as TRL "
                         "and tasks/reward_model.py write them (docs/reward-models.md says how to convert one)")
    if not is_classifier(config):
        raise ValueError(f"{where}: no scalar head: its config.json names "
                         f"{', '.join(config.get('architectures') or []) or 'no architecture'}, not a "
                         "...ForSequenceClassification (train one from preference pairs: python -m tasks.reward_model)")
    labels = num_labels(config, where)
    if labels != 1:
        raise ValueError(f"{where}: its head has {labels} labels; a reward model has one (a scalar score)")
    names = os.listdir(path)
    if not any(n.endswith(".safetensors") for n in names):
        pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
        raise FileNotFoundError(f"{where}: no weights there (*.safetensors)" + (
            f"; {', '.join(pickles)}: pickled weights, not loaded (loading a pickle can run code): save them as "
            "safetensors (save_pretrained does by default)" if pickles else ""))
    score_token(path, where)
    fmt = "chat" if is_chat(prompt_template) else "raw"
    trained = read_info(path).get("format")
    if trained is not None and trained != fmt:
        raise ValueError(f"{where} was trained on {trained!r} inputs ({INFO_FILE}) but this run's prompts give "
                         f"{fmt!r} ones (--prompt-template {prompt_template!r}): train it with --format {fmt}, or "
                         "choose a prompt template of its kind")
    if fmt == "chat":
        if not getattr(AutoTokenizer.from_pretrained(path), "chat_template", None):
            raise ValueError(f"{where}: its tokenizer has no chat template, and this run's prompts are chat turns "
                             f"(--prompt-template {prompt_template!r}): give it one, or use a raw prompt template")
    return fmt


def read_config(path: str, where: str) -> dict:
    """The config.json of the model directory `path` (check_model_dir has parsed it) as transformers needs it: an
    object whose architectures, when given, is a list of class names; else a one-line ValueError naming `where`."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: its config.json holds a JSON {type(config).__name__}, not an object (a model's "
                         "config)")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"{where}: its config.json's architectures is {json.dumps(archs)[:80]}, not a list of "
                         "class names")
    return config


def is_classifier(config: dict) -> bool:
    """Whether a config.json (read_config) names a ...ForSequenceClassification: a model with a scalar head."""
    return any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def num_labels(config: dict, where: str) -> int:
    """The label count of a config.json (read_config), as transformers reads it: id2label's size, else num_labels,
    else 2; a one-line ValueError naming `where` when either is given but is not an object or a whole number."""
    id2label, n = config.get("id2label"), config.get("num_labels")
    if id2label is not None and not isinstance(id2label, dict):
        raise ValueError(f"{where}: its config.json's id2label is {json.dumps(id2label)[:80]}, not an object of labels")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{where}: its config.json's num_labels is {json.dumps(n)[:80]}, not a whole number of "
                         "labels")
    return len(id2label) if id2label is not None else 2 if n is None else n


def weight_names(path: str) -> set[str]:
    """The names of the tensors in the safetensors weights of `path` (check_model_dir has checked them): its index's
    weight map, else model.safetensors' header (only the header is read); empty when there are none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        return set()
    with safe_open(single, "pt") as f:
        return set(f.keys())


def openrlhf_style(config: dict, names: set[str]) -> str | None:
    """What marks a reward model saved by OpenRLHF (its get_llm_for_sequence_regression), or None: a head called
    `value_head` (its default value_head_prefix), or the `normalize_reward` key that its loader writes into the
    config, with the mean and std it then divides by. transformers would load such a directory with a new random
    `score` head (a value head it does not know), or not as a classifier at all."""
    if "value_head.weight" in names:
        return "its head is value_head.weight, not score.weight"
    if "normalize_reward" in config and not is_classifier(config):
        return (f"its config.json has normalize_reward and names "
                f"{', '.join(config.get('architectures') or []) or 'no architecture'}")
    return None


def read_info(path: str) -> dict:
    """tasks/reward_model.py's record of how the reward model in `path` was trained ({} for any other)."""
    try:
        with open(os.path.join(path, INFO_FILE)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def score_token(path: str, where: str = "--reward-model") -> str:
    """Where the reward model in `path` is read (SCORE_TOKENS): its reward_model.json's score_token when
    tasks/reward_model.py trained it ("last" when the record predates the key: every version trained there), else
    transformers' rule, "last_non_pad"; a one-line ValueError for a value it does not know."""
    info = read_info(path)
    if "format" not in info:  # not trained here: read as transformers (and so TRL) trains and reads it
        return "last_non_pad"
    rule = info.get("score_token", "last")
    if rule not in SCORE_TOKENS:
        raise ValueError(f"{where}: its {INFO_FILE}'s score_token is {json.dumps(rule)[:80]}, not one of "
                         f"{', '.join(SCORE_TOKENS)}")
    return rule


# ----------------------------------------------------------------------------------------------------------------
# inputs and scores: the same code in training (tasks/reward_model.py) and in RL


def rm_input_ids(tokenizer, prompt: str, response: str, fmt: str) -> list[int]:
    """The token ids a reward model reads for (prompt, response) in format 'chat' or 'raw' (module docstring)."""
    if fmt == "chat":
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    ids = tokenizer.encode(prompt + response, add_special_tokens=True)
    eos = tokenizer.eos_token_id
    # the end-of-sequence token the policy wrote (decoding dropped it): the score is read there, once all is seen
    return list(ids) + ([eos] if eos is not None and (not ids or ids[-1] != eos) else [])


def score_head(model: nn.Module) -> nn.Linear:
    """The model's scalar head, `score` (transformers' ...ForSequenceClassification of decoder LMs); ValueError when
    it has none or more than one output."""
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no `score` head (nn.Linear); a reward model here is a decoder "
                         "LM's ...ForSequenceClassification")
    if head.out_features != 1:
        raise ValueError(f"{type(model).__name__}'s head has {head.out_features} outputs; a reward model has one")
    return head


def score_positions(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, skip_id: int | None) -> torch.Tensor:
    """last_B, the position each right-padded row is read at: its last token, or with skip_id its last token that is
    not skip_id (transformers' rule: pooled at the rightmost token != pad_token_id, position 0 when every one is)."""
    if skip_id is None:
        return attention_mask_BL.sum(-1) - 1
    keep_BL = attention_mask_BL.bool() & (input_ids_BL != skip_id)
    pos_L = torch.arange(input_ids_BL.shape[1], device=input_ids_BL.device)
    return (pos_L * keep_BL).argmax(-1)


def sequence_scores(model: nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor,
                    return_hidden: bool = False, skip_id: int | None = None):
    """score_B, fp32: the `score` head on the final hidden state of each row (rows right-padded) at score_positions:
    its last token, or with skip_id (a published model's pad token: RewardModel) its last token that is not skip_id;
    with return_hidden, (score_B, hidden_BLH) with every position's final hidden state."""
    base = getattr(model, model.base_model_prefix)
    hidden_BLH = base(input_ids=input_ids_BL, attention_mask=attention_mask_BL).last_hidden_state
    last_B = score_positions(input_ids_BL, attention_mask_BL, skip_id)
    hidden_BH = hidden_BLH[torch.arange(hidden_BLH.shape[0], device=hidden_BLH.device), last_B]
    head = score_head(model)
    bias = None if head.bias is None else head.bias.float()
    # the head's product in fp32 (its weights are in the compute dtype), also under autocast, which would run F.linear
    # in its 16-bit dtype whatever its inputs are: a score is never rounded to 16 bits
    with torch.autocast(hidden_BH.device.type, enabled=False):
        score_B = F.linear(hidden_BH.float(), head.weight.float(), bias).squeeze(-1)
    return (score_B, hidden_BLH) if return_hidden else score_B


def right_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_BL, attention_mask_BL), right-padded: with causal attention no real token sees a pad."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def pad_id_of(tokenizer) -> int:
    """Any id does under the mask; the tokenizer's own pad (or end-of-sequence) token when it has one."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return tid
    return 0


class RewardModel:
    """A reward model loaded for scoring: a whole copy on `device` in `precision`, eval mode, no gradient."""

    def __init__(self, path: str, fmt: str, precision: str, device, batch_tokens: int):
        path = os.path.expanduser(path)
        self.path, self.fmt, self.precision, self.device, self.batch_tokens = path, fmt, precision, device, batch_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[precision],
                                                                        use_safetensors=True).to(device)  # no pickle
        self.model.eval()
        score_head(self.model)
        self.pad_id = pad_id_of(self.tokenizer)
        self.score_token = score_token(path)
        # transformers' rule skips the config's pad token (not the tokenizer's); without one it reads the last token
        self.skip_id = (self.model.config.get_text_config().pad_token_id if self.score_token == "last_non_pad"
                        else None)
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)  # longer inputs are not scored
        self.too_long_reported = False

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        """The score of each token sequence, in float (nan or inf as the model gives them; nan for a sequence
        longer than the model's positions, which is not run)."""
        scores = [math.nan] * len(seqs)
        fits = [i for i, s in enumerate(seqs) if s and (self.max_len is None or len(s) <= self.max_len)]
        if len(fits) < len(seqs) and not self.too_long_reported:
            self.too_long_reported = True
            print(f"[reward] {len(seqs) - len(fits)} responses are longer than the reward model's {self.max_len} "
                  "positions: not scored, counted as reward failures (reported once)", file=sys.stderr, flush=True)
        for group in split_microbatches([len(seqs[i]) for i in fits], self.batch_tokens) if fits else []:
            idx = [fits[j] for j in group]
            ids, mask = right_pad([seqs[i] for i in idx], self.pad_id, self.device)
            for i, s in zip(idx, sequence_scores(self.model, ids, mask, skip_id=self.skip_id).cpu().tolist()):
                scores[i] = s
        return scores

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """The score of each (prompt text, response text): rm_input_ids, then score_ids."""
        return self.score_ids([rm_input_ids(self.tokenizer, p, r, self.fmt) for p, r in zip(prompts, responses)])

    def describe(self, policy_tokenizer=None) -> str:
        """One line for the start of a run: what scores, how, and with which tokenizer."""
        n = sum(p.numel() for p in self.model.parameters())
        how = ("its chat template around the prompt and the response" if self.fmt == "chat" else
               "prompt + response + its end-of-sequence token")
        where = ("its last token, as it was trained (its reward_model.json)" if self.score_token == "last" else
                 "its last token (transformers' rule; its config names no pad token)" if self.skip_id is None else
                 f"its last token that is not its pad token, id {self.skip_id} (transformers' rule)")
        line = (f"{self.path} ({type(self.model).__name__}, {n / 1e6:.1f}M parameters, {self.precision} on "
                f"{self.device.type}); input format {self.fmt}: {how}, the score read at {where}")
        if policy_tokenizer is not None:
            same = self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
            line += ("; its tokenizer is the policy's" if same else
                     f"; its own tokenizer (vocabulary {len(self.tokenizer)}, the policy's {len(policy_tokenizer)}): "
                     "responses are decoded and re-encoded with it")
        return line


# ----------------------------------------------------------------------------------------------------------------
# what a script uses: the learned reward of tasks.rewards.Reward


class RunningMeanStd:
    """Mean and variance of every value seen so far, merged a batch at a time in float64 (Chan, Golub and LeVeque's
    parallel update, "Updating formulae and a pairwise algorithm for computing sample variances", 1979)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0  # m2: sum of squared deviations from the mean

    def update(self, n: float, total: float, total_sq: float) -> None:
        """Merge a batch given by its count, sum and sum of squares (sums over all ranks: common.dist.reduce_stats)."""
        if n > 0:
            count, delta = self.count + n, total / n - self.mean
            self.m2 += max(total_sq - n * (total / n) ** 2, 0.0) + delta ** 2 * self.count * n / count
            self.mean += delta * n / count
            self.count = count

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


class LearnedReward:
    """The reward model's score as the reward that trains (tasks.rewards.Reward holds one with --reward-model),
    normalized and clipped per --rm-*. A cut or failed response gets the step's lowest reward over all ranks, or
    truncated_reward when lower: docs/reward-models.md, "Using one: the flags"."""
    said_failed = False  # a failed score is reported once per process

    def __init__(self, model, flags: RewardModelFlags, truncated_reward: float, device, template: str):
        """model: a scorer, score(prompts, responses) -> list[float] (a RewardModel)."""
        self.model, self.flags, self.truncated_reward, self.device = model, flags, truncated_reward, device
        self.template = template
        self.norm = RunningMeanStd() if flags.rm_normalize else None

    def score(self, stats, problems: list[str], responses: list[str], finished: list[bool]) -> tuple[list[float], int]:
        """Collective. (the rewards, failed scores) of decoded responses to `problems` (each one's problem text,
        before --prompt-template); the reward_model/* keys into stats."""
        todo = [i for i, done in enumerate(finished) if done]
        raw = self.model.score([prompt_text(problems[i], self.template) for i in todo], [responses[i] for i in todo])
        ok = [(i, x) for i, x in zip(todo, raw) if math.isfinite(x)]
        if len(ok) < len(todo) and not self.said_failed:
            LearnedReward.said_failed = True
            print(f"[reward] the reward model scored {len(todo) - len(ok)} of {len(todo)} responses "
                  f"{next(x for x in raw if not math.isfinite(x))} (given the step's lowest reward, counted in "
                  "train/reward_failures; reported once)", file=sys.stderr, flush=True)
        values = [x for _, x in ok]
        g = reduce_stats({"n": len(values), "sum": math.fsum(values), "sq": math.fsum(x * x for x in values)}, "sum",
                         self.device)
        hi = reduce_stats({"max": max(values, default=-math.inf), "neg_min": -min(values, default=math.inf)}, "max",
                          self.device)
        n, mean = g["n"], g["sum"] / g["n"] if g["n"] else math.nan  # (NaN when no response was scored)
        stats.set("reward_model/score_mean", mean)
        stats.set("reward_model/score_std", math.sqrt(max(g["sq"] / n - mean ** 2, 0.0)) if n else math.nan)
        stats.set("reward_model/score_max", hi["max"] if n else math.nan)
        stats.set("reward_model/score_min", -hi["neg_min"] if n else math.nan)
        lowest = -hi["neg_min"]  # the step's lowest score, every rank's (inf when none): normalizing and clipping
        if self.norm is not None:  # keep the order, so it becomes the lowest reward
            self.norm.update(n, g["sum"], g["sq"])  # every rank's scores of this step enter the running statistics
            scale = math.sqrt(self.norm.m2 / max(self.norm.count, 1.0) + 1e-8)
            values = [(x - self.norm.mean) / scale for x in values]
            lowest = (lowest - self.norm.mean) / scale
            stats.set("reward_model/running_mean", self.norm.mean)
            stats.set("reward_model/running_std", self.norm.std)
        if (c := self.flags.rm_clip) > 0:
            stats.add("reward_model/clip_frac", float(sum(abs(x) > c for x in values)), len(values))
            values = [min(max(x, -c), c) for x in values]
            lowest = min(max(lowest, -c), c)
        # a cut or failed response: never above a scored one, on the rewards' own scale (the class docstring)
        rewards = [min(self.truncated_reward, lowest) if n else self.truncated_reward] * len(finished)
        for (i, _), x in zip(ok, values):
            rewards[i] = x
        return rewards, len(todo) - len(ok)

    def state_dict(self) -> dict:
        """What a resumed run needs: the running mean and std of the scores (empty without --rm-normalize)."""
        return {"running": self.norm.state_dict()} if self.norm is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.norm is not None and "running" in state:
            self.norm.load_state_dict(state["running"])


@dataclass(frozen=True)
class Learned:
    """A checked --reward-model: what tasks.rewards.Reward loads at setup (it calls load; common/ imports no
    reward_model.py)."""
    flags: RewardModelFlags
    fmt: str  # the input format, 'chat' or 'raw' (check_reward_model)

    def load(self, kind: str, truncated_reward: float, tokenizer, device, template: str, precision: str,
             probe: list[dict] = ()) -> LearnedReward:
        """The reward model loaded (in --rm-precision, else the train precision `precision`) and said in a line; probe:
        a few problems ({problem, answer}) whose answers it scores at once: a ValueError here, before training, when it
        gives nan or inf."""
        flags, precision = self.flags, self.flags.rm_precision or precision
        model = RewardModel(flags.reward_model, self.fmt, precision, device, flags.rm_batch_tokens)
        on = " and ".join(w for w, yes in (("normalized", flags.rm_normalize), ("clipped", flags.rm_clip > 0)) if yes)
        print0(f"[reward] learned reward: {model.describe(tokenizer)}; --reward {kind} measures train/accuracy "
               "and the evaluation; a response cut at the length limit or whose score fails gets the step's lowest "
               f"reward{f' ({on})' if on else ''}, or --truncated-reward {truncated_reward:g} when that is lower")
        scores = model.score([prompt_text(p["problem"], template) for p in probe], [p["answer"] for p in probe])
        if bad := [x for x in scores if not math.isfinite(x)]:
            raise ValueError(f"--reward-model {flags.reward_model!r}: its forward gives {bad[0]} on {len(bad)} of "
                             f"{len(scores)} probe inputs (the first problems with their answers) in {precision}: "
                             "check its weights, or try --rm-precision fp32")
        return LearnedReward(model, flags, truncated_reward, device, template)


def check_run(args) -> Learned:
    """--reward-model in a script, before any model loads: check_reward_model of its flags (args.learned_reward) and
    args.prompt_template; the script hands the result to tasks.rewards.Reward."""
    return Learned(args.learned_reward, check_reward_model(args.learned_reward, args.prompt_template))

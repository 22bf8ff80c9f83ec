"""Rule-based rewards: did the response get the right final answer? (--reward; README, Rewards)
  math    math_reward: the last \\boxed{...} against the gold answer with math-verify (0.5 == \\frac{1}{2})
  exact   exact_match_reward: the whole stripped response equals the answer
  number  number_reward: the final number of the response (GSM8K style), compared numerically
  module:function   a plug-in fn(response, answer) -> float (sys.path, then the current directory)
The math check and the plug-ins run in time- and memory-bounded worker processes (common/reward_pool.py). A call that
raises, runs past its time limit or returns anything but a finite number scores 0 and counts as a failure
(train/reward_failures, eval/<name>/reward_failures); a step whose every check failed stops the run.
Reward (the end of this file) is a step's reward: the rule's, or with --reward-model a reward model's score
(reward_model.py, which the scripts import only with --reward-model and hand to Reward) with the rule beside it.
"""
import math
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch
import tyro

from common import exits
from common.data import prompt_text
from common.dist import print0, reduce_stats
from common.precision import TrainingFault
from common import reward_pool

exits.at_hard_exit(reward_pool.kill_now)  # a second Ctrl-C ends the process at once: its reward workers with it

PLUGIN_TIMEOUT_S = 5.0  # time limit of one call of a plug-in reward (--reward module:function), as math_reward's
PROGRESS_EVERY_S = 10.0  # score_rollout(progress=True) prints a line this often while checking
_verdicts = {}  # (pred, gold) -> 1.0/0.0. The same pairs recur a lot: a group of samples per prompt, epochs.
_stopping = threading.Event()  # set on Ctrl-C during score_rollout: the process is on its way out


# ----------------------------------------------------------------------------
# answer extraction and the cheap rewards


_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")  # "\boxed {x}" is valid LaTeX too


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces kept; None if absent/unbalanced."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    start = i = starts[-1]
    depth = 1
    while i < len(text):
        c = text[i]
        if c == "\\":  # skip the escaped char: \{ and \} are literal braces, not grouping
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None  # the braces never closed (e.g. the response was cut at the length limit)


def exact_match_reward(response: str, answer: str) -> float:
    """For the built-in arithmetic task: the whole response is the answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


# A number as written in prose: "1,234" (commas only between groups of three digits, so "1, 2" is two numbers),
# "-5", "+5", "−5" (U+2212, the Unicode minus), "3.50", ".5". A sign counts only where it cannot be a binary
# minus or plus: "10-4" ends in 4, not -4. A "." with no digit after it ends the number ("14." is 14). What surrounds
# it is ignored: "$12", "\$14", "12%" and "14apples" all give the number itself. Not read: exponents ("1e5" is 1
# and 5), fractions ("3/4" is 3 and 4).
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])([-+\u2212]))?"  # group 1: a unary sign
                        r"((?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")  # group 2: the number
_HASHES_RE = re.compile(r"####")
_ANSWER_IS_RE = re.compile(r"\banswer\s+is\b|\banswer\s*:", re.IGNORECASE)  # also "The final answer is", "Answer:"


def _parse_number(match: re.Match) -> Fraction | None:
    try:
        value = Fraction(match.group(2).replace(",", ""))  # exact: "3.50" is 7/2, not a float
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits): no usable number
        return None
    return -value if match.group(1) in ("-", "\u2212") else value


def extract_number(text: str) -> Fraction | None:
    """The final answer of a text as a number, GSM8K style, or None if there is none. In order of precedence:
    (a) the first number after the last "####"; (b) the first number after the last "answer is" / "answer:"
    (any case: "The answer is 7.", "Final answer: 7"); (c) the last number of the text. A marker with no number
    after it is passed over."""
    for marker in (_HASHES_RE, _ANSWER_IS_RE):
        ends = [m.end() for m in marker.finditer(text)]
        if ends:
            first = _NUMBER_RE.search(text, ends[-1])
            if first is not None:
                return _parse_number(first)
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    return None if last is None else _parse_number(last)


def number_reward(response: str, answer: str) -> float:
    """1.0 if the response's final number (extract_number) equals the gold answer's, else 0.0 (also when either
    has no number). The gold answer is read the same way: "42", "1,234" or a worked solution ending "#### 42".
    Integers must be equal; otherwise the relative difference must be at most 1e-6 ("3.50" == "3.5" exactly)."""
    pred, gold = extract_number(response), extract_number(str(answer))
    if pred is None or gold is None:
        return 0.0
    if pred.denominator == 1 and gold.denominator == 1:
        return 1.0 if pred == gold else 0.0
    return 1.0 if abs(pred - gold) <= 1e-6 * max(abs(pred), abs(gold)) else 0.0


def _gold_answer(answer: str) -> str:
    """The short answer to compare against, from a bare answer or a full worked solution."""
    if "\\boxed" in answer or "\\fbox" in answer:
        boxed = extract_boxed(answer)
        if boxed is not None:
            return boxed.strip()
    if "####" in answer:  # GSM8K style: worked solution, then "#### 42"
        return answer.rsplit("####", 1)[1].strip()
    return answer.strip()


def math_reward(response: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 if the response's last boxed answer equals the gold answer per math-verify, else 0.0. Returns within about
    timeout_s + 1 s (after the first call, which starts a worker process), from any thread."""
    verdict = _math_verdict(response, answer, timeout_s)
    return 0.0 if verdict is None else verdict


def _math_verdict(response: str, answer: str, timeout_s: float = 5.0) -> float | None:
    """math_reward, but None when the check could not finish (timed out, or its worker died)."""
    pred = extract_boxed(response)
    if pred is None:
        return 0.0
    pred, gold = pred.strip(), _gold_answer(answer)
    if not pred or not gold:
        return 0.0
    if pred == gold:  # the common case needs no sympy at all
        return 1.0
    key = (pred, gold)
    if key not in _verdicts:
        verdict = reward_pool.check_math(pred, gold, float(timeout_s))
        if verdict is None:  # timed out: not remembered, it may just be a busy machine
            return None
        if len(_verdicts) >= 50_000:  # crude bound on memory
            _verdicts.clear()
        _verdicts[key] = verdict
    return _verdicts[key]


REWARD_FNS = {"math": math_reward, "exact": exact_match_reward, "number": number_reward}


def score_responses(responses: list[str], answers: list[str], finished: list[bool], kind: str,
                    truncated_reward: float = 0.0) -> list[float]:
    """Reward per response; one cut at the length limit (finished=False) gets truncated_reward."""
    return score_rollout(responses, answers, finished, kind, truncated_reward)[0]


def score_rollout(responses: list[str], answers: list[str], finished: list[bool], kind: str,
                  truncated_reward: float = 0.0, progress: bool = False) -> tuple[list[float], int]:
    """(reward per response, number of failed checks). A check that raises, times out or loses its worker scores 0
    and is counted (the scripts stop when every check of a step failed). kind: math, exact, number or
    module:function. progress: print a line every PROGRESS_EVERY_S while checking (a slow reward is not silence)."""
    check_reward(kind)  # a bad kind raises ValueError; a known one returns at once
    if not len(responses) == len(answers) == len(finished):
        raise ValueError(f"score_responses: got {len(responses)} responses, {len(answers)} answers, "
                         f"{len(finished)} finished flags")
    fn = _CHECKS.get(kind) or (lambda response, answer:  # a plug-in: in a worker, PLUGIN_TIMEOUT_S per call
                               reward_pool.call_plugin(kind, response, answer, PLUGIN_TIMEOUT_S))

    def check(i: int) -> float | None:
        try:
            return fn(responses[i], answers[i])
        except Exception as e:  # noqa: BLE001 -- whatever a reward function raises, training goes on
            if not _stopping.is_set():  # (after a Ctrl-C: the checks killed on the way out are no failures)
                _report_failure(e)
            return None

    rewards = [float(truncated_reward)] * len(responses)
    todo = [i for i, done in enumerate(finished) if done]
    # math and plug-in checks mostly wait on worker processes, so keep several in flight from threads;
    # repeated (answer, gold) pairs, common within a group of samples, hit the math cache
    n_threads = min(reward_pool.NUM_WORKERS, len(todo)) if kind not in ("exact", "number") else 1
    verdicts = {}
    t0 = shown = time.monotonic()

    def record(i: int, verdict: float | None) -> None:
        nonlocal shown
        verdicts[i] = verdict
        if progress and time.monotonic() - shown >= PROGRESS_EVERY_S:
            shown = time.monotonic()
            failed = sum(v is None for v in verdicts.values())
            print(f"[reward] {len(verdicts)} of {len(todo)} responses checked in {shown - t0:.0f} s ({failed} "
                  "failed)", flush=True)

    pool = ThreadPoolExecutor(max(n_threads, 1))
    try:
        futures = {pool.submit(check, i): i for i in todo}
        for future in as_completed(futures):
            record(futures[future], future.result())
    except BaseException:  # Ctrl-C: stop the checks now rather than wait for them, and quietly
        _stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        reward_pool.kill_all()  # the checks in flight return at once (their worker is gone); none is reported
        raise
    pool.shutdown()
    failures = 0
    for i in todo:
        rewards[i] = 0.0 if verdicts[i] is None else float(verdicts[i])
        failures += verdicts[i] is None
    return rewards, failures


# as REWARD_FNS, None meaning "could not check"
_CHECKS = {"math": _math_verdict, "exact": exact_match_reward, "number": number_reward}
_reported = set()


def _report_failure(e: Exception) -> None:
    """One line per kind of exception and process, not one per response."""
    name = e.type_name if isinstance(e, reward_pool.RewardFunctionError) else type(e).__name__
    if name not in _reported:
        _reported.add(name)
        print(f"[reward] a reward check raised {name}: {e} (scored 0, counted in the reward_failures metrics; "
              "reported once)", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# plug-in rewards (--reward module:function)


_PLUGIN_RE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_checked_plugins = set()  # specs check_reward accepted, so score_rollout need not import them again each step


def check_reward(kind: str) -> None:
    """Raise a one-line ValueError unless kind is math, exact, number, or a plug-in "module:function" whose module
    imports (from sys.path, then the current directory) and whose function is callable. The scripts call it before
    loading a model. A plug-in is imported in a worker process, as the calls will be, within
    reward_pool.IMPORT_TIMEOUT_S: never in this process, so that a module which hangs (or does anything else) at
    import cannot hang or change the training process."""
    if kind in _CHECKS or kind in _checked_plugins:
        return
    if not _PLUGIN_RE.fullmatch(kind):
        raise ValueError(f"--reward {kind!r}: unknown reward kind; choose {', '.join(_CHECKS)} or module:function "
                         "(e.g. my_rewards:score)")
    try:
        reward_pool.check_plugin(kind)
    except reward_pool.RewardFunctionError as e:  # whatever the module raises on import, the user gets one line
        raise ValueError(f"--reward {kind!r}: {' '.join(str(e).split())}") from None
    _checked_plugins.add(kind)


def check_step_rewards(step: int, failures: int, checked: int, device) -> None:
    """Collective. Raise TrainingFault when every reward check of the step, over all ranks, failed: a broken reward
    function, and nothing to learn from zeros."""
    n = reduce_stats({"failed": failures, "checked": checked}, "sum", device)
    if n["checked"] and n["failed"] == n["checked"]:
        raise TrainingFault(f"step {step}: every reward check of the step failed ({int(n['failed'])} responses; the "
                            "first error of each kind is printed above); stopped before training on it")


@dataclass
class RewardModelFlags:
    """The learned-reward flags, one Args field (`learned_reward`) of the scripts: flat on the command line
    (--reward-model, --rm-*) and in config.json."""
    reward_model: str | None = None
    """a reward model directory (Hugging Face AutoModelForSequenceClassification, one label; tasks/reward_model.py
    trains one): its score of prompt + response is the reward that trains, and --reward only measures
    (train/accuracy, eval/*). None: --reward trains"""
    rm_precision: Literal["fp16", "bf16", "fp32"] | None = None
    """the reward model's compute precision (default: the train precision)"""
    rm_batch_tokens: int = 32768
    """token budget of one scoring forward of the reward model (rows x longest row, padding included)"""
    rm_normalize: bool = False
    """normalize each score by the running mean and std of every score so far (all ranks, this step's included):
    (s - mean) / sqrt(var + 1e-8); the running state goes into the checkpoints"""
    rm_clip: float = 0.0
    """clip the (normalized) score to [-rm_clip, rm_clip]; 0: no clip"""


# an Args field's type: the flags are --reward-model and --rm-*, not --learned-reward.reward-model
RewardModelField = tyro.conf.OmitArgPrefixes[RewardModelFlags]


def check_reward_flags(flags: RewardModelFlags) -> None:
    """Without --reward-model, no --rm-* flag: a one-line ValueError naming the ones given. (With one,
    reward_model.py's check_reward_model checks the rest; the scripts import it only then.)"""
    if flags.reward_model is not None:
        return
    default = RewardModelFlags()
    changed = [name for name, on in (("--rm-precision", flags.rm_precision is not None),
                                     ("--rm-batch-tokens", flags.rm_batch_tokens != default.rm_batch_tokens),
                                     ("--rm-normalize", flags.rm_normalize), ("--rm-clip", flags.rm_clip != 0))
               if on]
    if changed:
        raise ValueError(f"{', '.join(changed)}: no --reward-model to apply to")


class RunningMeanStd:
    """Mean and variance of every value seen so far, merged a batch at a time (Chan, Golub and LeVeque's parallel
    update, "Updating formulae and a pairwise algorithm for computing sample variances", 1979), in float64."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0  # m2: sum of squared deviations from the mean

    def update(self, n: float, total: float, total_sq: float) -> None:
        """Merge a batch given by its count, sum and sum of squares (sums over all ranks: common.dist.reduce_stats)."""
        if n <= 0:
            return
        mean_b = total / n
        m2_b = max(total_sq - n * mean_b ** 2, 0.0)
        count = self.count + n
        delta = mean_b - self.mean
        self.mean += delta * n / count
        self.m2 += m2_b + delta ** 2 * self.count * n / count
        self.count = count

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


class Reward:
    """The reward of a step (step 2), built once at setup: the rule (--reward), a response cut at the length limit
    getting truncated_reward; or, with `learned` (reward_model.py's Learned: load(precision, device) gives a scorer
    with score(prompts, responses) and describe(tokenizer)), the reward model's score, the rule only measuring
    (train/accuracy; evaluation stays the rule's). A cut or failed response then gets the step's lowest reward over
    all ranks, or truncated_reward when lower: docs/reward-models.md, "Using one: the flags"."""

    def __init__(self, kind: str, truncated_reward: float, tokenizer, device, progress: bool, learned=None,
                 template: str = "{problem}", precision: str = "fp32", probe: list[dict] = ()):
        """precision: the train precision, the reward model's unless --rm-precision says otherwise. probe: a few
        problems ({problem, answer}) whose answers the reward model scores at once: a ValueError here, before
        training, when it gives nan or inf."""
        check_reward(kind)
        self.kind, self.truncated_reward, self.tokenizer = kind, float(truncated_reward), tokenizer
        self.device, self.progress, self.learned, self.template = device, progress, learned, template
        self.model = self.norm = None
        if learned is None:
            return
        precision = learned.flags.rm_precision or precision
        self.model = learned.load(precision, device)
        self.learned = learned = learned.flags  # the --reward-model and --rm-* flags, from here on
        self.norm = RunningMeanStd() if learned.rm_normalize else None
        on = " and ".join(w for w, yes in (("normalized", learned.rm_normalize), ("clipped", learned.rm_clip > 0))
                          if yes)
        print0(f"[reward] learned reward: {self.model.describe(tokenizer)}; --reward {kind} measures train/accuracy "
               "and the evaluation; a response cut at the length limit or whose score fails gets the step's lowest "
               f"reward{f' ({on})' if on else ''}, or --truncated-reward {self.truncated_reward:g} when that is lower")
        scores = self.model.score([prompt_text(p["problem"], template) for p in probe], [p["answer"] for p in probe])
        bad = [x for x in scores if not math.isfinite(x)]
        if bad:
            raise ValueError(f"--reward-model {learned.reward_model!r}: its forward gives {bad[0]} on {len(bad)} of "
                             f"{len(scores)} probe inputs (the first problems with their answers) in {precision}: "
                             "check its weights, or try --rm-precision fp32")

    def __call__(self, step: int, rollout, problems: list[dict], stats) -> torch.Tensor:
        """rewards_B, one per response (the rollout holds each problem's group in order, as samplers return it), and
        into stats: train/accuracy (the rule's mean verdict), train/reward_failures (of the reward that trains), the
        fractions of groups all right (train/all_correct_frac) and all wrong (train/all_wrong_frac), which give no
        learning signal, time/reward, and with a reward model the reward_model/* keys."""
        t0 = time.perf_counter()
        group_size = len(rollout.response_ids) // len(problems)
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        rewards, correct, failures = self.score(stats, [p["problem"] for p in problems for _ in range(group_size)],
                                                texts, [p["answer"] for p in problems for _ in range(group_size)],
                                                rollout.finished)
        check_step_rewards(step, failures, sum(rollout.finished), self.device)
        c_GN = torch.tensor(correct).view(-1, group_size)
        stats.add("train/accuracy", c_GN.sum(), c_GN.numel())
        stats.add("train/reward_failures", float(failures))
        stats.add("train/all_correct_frac", (c_GN.min(-1).values == 1).sum(), len(c_GN))
        stats.add("train/all_wrong_frac", (c_GN.max(-1).values == 0).sum(), len(c_GN))
        stats.set("time/reward", time.perf_counter() - t0)
        return torch.tensor(rewards)

    def score(self, stats, problems: list[str], responses: list[str], answers: list[str],
              finished: list[bool]) -> tuple[list[float], list[float], int]:
        """(the rewards that train, the rule's verdicts, failed checks of the reward that trains) of decoded responses
        to `problems` (each response's problem text, before --prompt-template). With a reward model: collective
        (every rank calls it), and the reward_model/* keys into stats."""
        if self.model is None:
            rewards, failures = score_rollout(responses, answers, finished, self.kind, self.truncated_reward,
                                              self.progress)
            return rewards, rewards, failures
        # the rule measures: a cut response is not a correct one, whatever --truncated-reward gives it
        correct, rule_failures = score_rollout(responses, answers, finished, self.kind, 0.0, self.progress)
        todo = [i for i, done in enumerate(finished) if done]
        raw = self.model.score([prompt_text(problems[i], self.template) for i in todo], [responses[i] for i in todo])
        ok = [(i, x) for i, x in zip(todo, raw) if math.isfinite(x)]
        if len(ok) < len(todo) and "reward model" not in _reported:
            _reported.add("reward model")
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
        stats.add("reward_model/rule_failures", float(rule_failures))
        lowest = -hi["neg_min"]  # the step's lowest score, every rank's (inf when none): normalizing and clipping
        if self.norm is not None:  # keep the order, so it becomes the lowest reward
            self.norm.update(n, g["sum"], g["sq"])  # every rank's scores of this step enter the running statistics
            scale = math.sqrt(self.norm.m2 / max(self.norm.count, 1.0) + 1e-8)
            values = [(x - self.norm.mean) / scale for x in values]
            lowest = (lowest - self.norm.mean) / scale
            stats.set("reward_model/running_mean", self.norm.mean)
            stats.set("reward_model/running_std", self.norm.std)
        if self.learned.rm_clip > 0:
            c = self.learned.rm_clip
            stats.add("reward_model/clip_frac", float(sum(abs(x) > c for x in values)), len(values))
            values = [min(max(x, -c), c) for x in values]
            lowest = min(max(lowest, -c), c)
        # a cut or failed response: never above a scored one, on the rewards' own scale (Reward's docstring)
        penalty = min(self.truncated_reward, lowest) if n else self.truncated_reward
        rewards = [penalty] * len(finished)
        for (i, _), x in zip(ok, values):
            rewards[i] = x
        return rewards, correct, len(todo) - len(ok)

    def state_dict(self) -> dict:
        """What a resumed run needs: the running mean and std of the scores (empty without --rm-normalize)."""
        return {"running": self.norm.state_dict()} if self.norm is not None else {}

    def load_state_dict(self, state: dict | None) -> None:
        if self.norm is not None and state and "running" in state:
            self.norm.load_state_dict(state["running"])


def evaluate(sampler, tokenizer, eval_sets: dict[str, list[dict]], infra, max_new_tokens: int, reward: str,
             rank: int, world_size: int, device) -> dict:
    """Collective. avg@k accuracy on each evaluation set (name -> encoded problems: prompt_ids, answer), with its own
    sampling settings (--eval-k, --eval-temperature, --eval-top-p of `infra`, common.cli.Infra); each rank samples its
    share of the problems, counts are summed over ranks. Returns
    {eval/<name>/accuracy: mean reward, eval/<name>/reward_failures: checks that raised or timed out (scored 0)}.
    Every rank calls `generate`, also with an empty share: with --vllm-tp > 1 it is a collective of the
    tensor-parallel group."""
    k = infra.eval_k
    metrics = {}
    for name, problems in eval_sets.items():
        mine = problems[rank::world_size]
        out = sampler.generate([p["prompt_ids"] for p in mine], k, max_new_tokens, infra.eval_temperature,
                               infra.eval_top_p)  # even if []
        texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True) if mine else []
        answers = [p["answer"] for p in mine for _ in range(k)]
        scores, failed = score_rollout(texts, answers, out.finished, reward, progress=rank == 0) if mine else ([], 0)
        s = reduce_stats({"correct": float(sum(scores)), "failed": failed, "n": len(mine) * k}, "sum", device)
        metrics[f"eval/{name}/accuracy"] = s["correct"] / max(s["n"], 1.0)
        metrics[f"eval/{name}/reward_failures"] = s["failed"]
    return metrics

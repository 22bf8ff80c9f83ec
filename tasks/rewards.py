"""Rule-based rewards (--reward; README, Rewards): math, the last \\boxed{...} against the gold answer with math-verify;
exact, the whole stripped response; number, the final number (GSM8K style); module:function, a plug-in fn(response,
answer) -> float. The math check and the plug-ins run in time- and memory-bounded worker processes (reward_pool.py).
A check that raises, times out or returns a non-finite number scores 0 and counts as a failure (reward_failures); a
step whose every check failed stops the run. Reward: a step's reward, the rule's or (--reward-model) a reward model's.
"""
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Literal

import torch
import tyro

from common import exits
from common.dist import reduce_stats
from common.precision import TrainingFault
from tasks import reward_pool

exits.at_hard_exit(reward_pool.kill_now)  # a second Ctrl-C ends the process at once: its reward workers with it

PLUGIN_TIMEOUT_S = 5.0  # time limit of one call of a plug-in reward (--reward module:function), as math_reward's
PROGRESS_EVERY_S = 10.0  # score_rollout(progress=True) prints a line this often while checking
_verdicts = {}  # (pred, gold) -> 1.0/0.0. The same pairs recur a lot: a group of samples per prompt, epochs.
_stopping = threading.Event()  # set on Ctrl-C during score_rollout: the process is on its way out
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")  # "\boxed {x}" is valid LaTeX too
# A number in prose: "1,234" (commas only between groups of three digits: "1, 2" is two numbers), "-5", "+5", "−5"
# (U+2212), "3.50", ".5". A sign only where it cannot be a binary minus/plus ("10-4" ends in 4). "14." is 14, and
# "$12", "12%", "14apples" give the number. Not read: exponents ("1e5" is 1 and 5), fractions ("3/4" is 3 and 4).
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])([-+\u2212]))?"  # group 1: a unary sign
                        r"((?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")  # group 2: the number
_MARKERS = (re.compile(r"####"), re.compile(r"\banswer\s+is\b|\banswer\s*:", re.IGNORECASE))  # "Final answer: 7"


def _last(items):
    return (list(items) or [None])[-1]


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces kept; None if absent/unbalanced."""
    if (start := _last(m.end() for m in _BOXED_RE.finditer(text))) is None:
        return None
    depth, i = 1, start
    while i < len(text):
        if text[i] == "\\":  # skip the escaped char: \{ and \} are literal braces, not grouping
            i += 1
        elif text[i] in "{}":
            depth += 1 if text[i] == "{" else -1
            if depth == 0:
                return text[start:i]
        i += 1
    return None  # the braces never closed (e.g. the response was cut at the length limit)


def exact_match_reward(response: str, answer: str) -> float:
    """For the built-in arithmetic task: the whole response is the answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def extract_number(text: str) -> Fraction | None:
    """The final answer of a text as a number, GSM8K style, or None. In order of precedence: the first number after
    the last "####", after the last "answer is" / "answer:" (any case), the last number. A marker with no number after
    it is passed over."""
    for marker in _MARKERS:
        last = _last(marker.finditer(text))
        if match := last and _NUMBER_RE.search(text, last.end()):
            break
    else:
        match = _last(_NUMBER_RE.finditer(text))
    if match is None:
        return None
    try:
        value = Fraction(match.group(2).replace(",", ""))  # exact: "3.50" is 7/2, not a float
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits): no usable number
        return None
    return -value if match.group(1) in ("-", "\u2212") else value


def number_reward(response: str, answer: str) -> float:
    """1.0 if the response's final number (extract_number) equals the gold answer's (read the same way: "42", "1,234",
    "... #### 42"), else 0.0. Integers must be equal, others within a relative 1e-6 ("3.50" == "3.5" exactly)."""
    pred, gold = extract_number(response), extract_number(str(answer))
    if pred is None or gold is None:
        return 0.0
    tolerance = 0 if pred.denominator == gold.denominator == 1 else 1e-6 * max(abs(pred), abs(gold))
    return 1.0 if abs(pred - gold) <= tolerance else 0.0


def math_reward(response: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 if the response's last boxed answer equals the gold answer per math-verify, else 0.0. Returns within about
    timeout_s + 1 s (after the first call, which starts a worker process), from any thread."""
    return _math_verdict(response, answer, timeout_s) or 0.0


def _math_verdict(response: str, answer: str, timeout_s: float = 5.0) -> float | None:
    """math_reward, but None when the check could not finish (timed out, or its worker died)."""
    # the gold answer: a worked solution's last box, what follows GSM8K's final "####", or the whole (bare) answer
    boxed, pred = extract_boxed(answer), (extract_boxed(response) or "").strip()
    gold = (boxed if boxed is not None else answer.rsplit("####")[-1]).strip()
    if not pred or not gold:
        return 0.0
    if pred == gold:  # the common case needs no sympy at all
        return 1.0
    if (pred, gold) not in _verdicts:
        verdict = reward_pool.check_math(pred, gold, float(timeout_s))
        if verdict is None:  # timed out: not remembered, it may just be a busy machine
            return None
        if len(_verdicts) >= 50_000:  # crude bound on memory
            _verdicts.clear()
        _verdicts[pred, gold] = verdict
    return _verdicts[pred, gold]


REWARD_FNS = {"math": math_reward, "exact": exact_match_reward, "number": number_reward}
_CHECKS = {**REWARD_FNS, "math": _math_verdict}  # as REWARD_FNS, None meaning "could not check"
_reported = set()  # the kinds of failure reported (once per process)


def score_responses(responses: list[str], answers: list[str], finished: list[bool], kind: str,
                    truncated_reward: float = 0.0) -> list[float]:
    """Reward per response; one cut at the length limit (finished=False) gets truncated_reward."""
    return score_rollout(responses, answers, finished, kind, truncated_reward)[0]


def score_rollout(responses: list[str], answers: list[str], finished: list[bool], kind: str,
                  truncated_reward: float = 0.0, progress: bool = False) -> tuple[list[float], int]:
    """(reward per response, number of failed checks: raised, timed out or lost its worker; each scores 0).
    progress: print a line every PROGRESS_EVERY_S while checking (a slow reward is not silence)."""
    check_reward(kind)  # a bad kind raises ValueError; a known one returns at once
    if not len(responses) == len(answers) == len(finished):
        raise ValueError(f"score_responses: got {len(responses)} responses, {len(answers)} answers, "
                         f"{len(finished)} finished flags")
    fn = _CHECKS.get(kind) or partial(reward_pool.call_plugin, kind, timeout_s=PLUGIN_TIMEOUT_S)  # in a worker

    def check(i: int) -> float | None:
        try:
            return fn(responses[i], answers[i])
        except Exception as e:  # noqa: BLE001 -- whatever a reward function raises, training goes on
            if not _stopping.is_set():  # (after a Ctrl-C: the checks killed on the way out are no failures)
                _report_failure(e)
            return None

    todo, verdicts = [i for i, done in enumerate(finished) if done], {}
    t0 = shown = time.monotonic()
    # math and plug-in checks mostly wait on worker processes, so keep several in flight from threads
    pool = ThreadPoolExecutor(max(min(reward_pool.NUM_WORKERS, len(todo)), 1) if kind not in ("exact", "number") else 1)
    try:
        futures = {pool.submit(check, i): i for i in todo}
        for future in as_completed(futures):
            verdicts[futures[future]] = future.result()
            if progress and time.monotonic() - shown >= PROGRESS_EVERY_S:
                shown = time.monotonic()
                print(f"[reward] {len(verdicts)} of {len(todo)} responses checked in {shown - t0:.0f} s "
                      f"({sum(v is None for v in verdicts.values())} failed)", flush=True)
    except BaseException:  # Ctrl-C: stop the checks now rather than wait for them, and quietly
        _stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        reward_pool.kill_all()  # the checks in flight return at once (their worker is gone); none is reported
        raise
    pool.shutdown()
    rewards = [float(truncated_reward)] * len(responses)
    for i, v in verdicts.items():
        rewards[i] = 0.0 if v is None else float(v)
    return rewards, sum(v is None for v in verdicts.values())


def _report_failure(e: Exception) -> None:
    """One line per kind of exception and process, not one per response."""
    name = e.type_name if isinstance(e, reward_pool.RewardFunctionError) else type(e).__name__
    if name not in _reported:
        _reported.add(name)
        print(f"[reward] a reward check raised {name}: {e} (scored 0, counted in the reward_failures metrics; "
              "reported once)", file=sys.stderr, flush=True)


_PLUGIN_RE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_checked_plugins = set()  # specs check_reward accepted, so score_rollout need not import them again each step


def check_reward(kind: str) -> None:
    """Raise a one-line ValueError unless kind is math, exact, number, or a plug-in "module:function" whose module
    imports (sys.path, then the current directory) and whose function is callable; the scripts call it before loading a
    model. The import runs in a worker within reward_pool.IMPORT_TIMEOUT_S, never here: a module that hangs (or does
    anything else) at import cannot hang or change the training process."""
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


def check_args(args) -> None:
    """A script's --reward and --rm-* flags, before any model loads (the scripts' validate)."""
    check_reward(args.reward)  # imports a plug-in's module (in a worker), so that a typo fails before any model loads
    check_reward_flags(args.learned_reward)  # no --rm-* flag without --reward-model (reward_model.py checks the rest)


def check_step_rewards(step: int, failures: int, checked: int, device) -> None:
    """Collective. TrainingFault when every reward check of the step, over all ranks, failed: a broken reward
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
    """Without --reward-model, no --rm-* flag: a one-line ValueError naming the ones given. (With one, reward_model.py's
    check_reward_model checks the rest; the scripts import it only then.)"""
    changed = [name for name, on in (("--rm-precision", flags.rm_precision is not None),
                                     ("--rm-batch-tokens", flags.rm_batch_tokens != RewardModelFlags.rm_batch_tokens),
                                     ("--rm-normalize", flags.rm_normalize), ("--rm-clip", flags.rm_clip != 0)) if on]
    if flags.reward_model is None and changed:
        raise ValueError(f"{', '.join(changed)}: no --reward-model to apply to")


class Reward:
    """The reward of a step (step 2), built once at setup: the rule (--reward), a response cut at the length limit
    getting truncated_reward; or, with `learned` (reward_model.py's Learned, only with --reward-model), the reward
    model's score (its LearnedReward), the rule only measuring (train/accuracy; evaluation stays the rule's)."""

    def __init__(self, kind: str, truncated_reward: float, tokenizer, device, progress: bool, learned=None,
                 template: str = "{problem}", precision: str = "fp32", probe: list[dict] = ()):
        """precision: the train precision; probe: a few problems ({problem, answer}) for the reward model to score at
        once, before training (Learned.load)."""
        check_reward(kind)
        self.kind, self.truncated_reward, self.tokenizer = kind, float(truncated_reward), tokenizer
        self.device, self.progress = device, progress
        self.learned = None if learned is None else learned.load(kind, self.truncated_reward, tokenizer, device,
                                                                 template, precision, probe)

    def __call__(self, step: int, rollout, problems: list[dict], stats) -> torch.Tensor:
        """rewards_B, one per response (each problem's group in order, as samplers return it); into stats:
        train/accuracy (the rule's), train/reward_failures (of the reward that trains), train/all_correct_frac and
        train/all_wrong_frac (groups that give no learning signal), time/reward, and the reward_model/* keys."""
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
        to `problems` (each one's problem text, before --prompt-template). With a reward model: collective."""
        # beside a reward model the rule measures: a cut response is not a correct one, whatever --truncated-reward
        truncated = self.truncated_reward if self.learned is None else 0.0
        correct, failures = score_rollout(responses, answers, finished, self.kind, truncated, self.progress)
        if self.learned is None:
            return correct, correct, failures
        rewards, rm_failures = self.learned.score(stats, problems, responses, finished)
        stats.add("reward_model/rule_failures", float(failures))
        return rewards, correct, rm_failures

    def state_dict(self) -> dict:
        """What a resumed run needs: the reward model's running score statistics (empty without --rm-normalize)."""
        return self.learned.state_dict() if self.learned is not None else {}

    def load_state_dict(self, state: dict | None) -> None:
        if self.learned is not None and state:
            self.learned.load_state_dict(state)


def evaluate(sampler, tokenizer, eval_sets: dict[str, list[dict]], infra, max_new_tokens: int, reward: str,
             rank: int, world_size: int, device) -> dict:
    """Collective. {eval/<name>/accuracy (avg@k), eval/<name>/reward_failures} of each evaluation set (name -> encoded
    problems), sampled with infra's --eval-k/--eval-temperature/--eval-top-p; each rank samples its share. Every rank
    calls `generate`, also with an empty share: with --vllm-tp > 1 it is a collective of the tensor-parallel group."""
    k, metrics = infra.eval_k, {}
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

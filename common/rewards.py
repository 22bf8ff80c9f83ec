"""Rule-based rewards: did the response get the right final answer?

The kinds of --reward (score_rollout's kind):
  math    math_reward: the last \\boxed{...} of a response against the gold answer,
          with the math-verify library (so 0.5 == \\frac{1}{2}, 2\\sqrt{2} == \\sqrt{8}, ...)
  exact   exact_match_reward: the whole stripped response equals the answer
  number  number_reward: the final number of the response (GSM8K style), compared
          numerically with the gold answer's
  module:function
          a plug-in: fn(response: str, answer: str) -> float, imported from the
          module (sys.path, then the current directory) and called in the same
          time-limited worker processes as the math check (PLUGIN_TIMEOUT_S per call)

Why the math check runs in helper processes
-------------------------------------------
math-verify parses LaTeX into sympy and simplifies; a hostile answer such as
\\boxed{9^{9^{9^{9^{9}}}}} can make that run (and allocate) without end. Its own
timeouts use signal.alarm, which
  - only works in the main thread (it raises in a worker thread, and turning it
    off there means no time bound at all),
  - replaces the process-wide SIGALRM handler of the training process, and
  - cannot stop code that never returns to the Python interpreter.
So every check is sent to a small pool of persistent worker processes (this very
file run as a script, talking JSON lines over pipes). Inside a worker, a SIGALRM
timer (it is the worker's main thread) stops slow Python code and the worker
stays up; if the worker still has not answered shortly after, it is killed and a
fresh one is started on demand. This works the same from any thread of the
caller, costs no process spawn per response (only one per worker, and one after
each kill), and lets score_responses check many responses in parallel.
We use subprocess rather than multiprocessing so the worker never re-imports the
training script (spawn/forkserver do that) and never forks a process that holds
CUDA or tokenizer threads.
A plug-in reward runs in the same workers for the same reasons: it may hang or
crash, and it must not take the training process down with it. A call that
raises, runs past its time limit or returns anything but a finite number scores
0 and counts as a failure (train/reward_failures, eval/<name>/reward_failures), like a math
check that times out. A step whose every check failed stops the run (the scripts check it).
"""

import atexit
import importlib
import json
import logging
import math
import numbers
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from fractions import Fraction
from functools import lru_cache

NUM_WORKERS = min(8, os.cpu_count() or 1)  # processes (and threads) used by score_responses
PLUGIN_TIMEOUT_S = 5.0  # time limit of one call of a plug-in reward (--reward module:function), as math_reward's
_KILL_GRACE_S = 1.0  # extra wait past the in-worker timer before we kill the worker
_START_TIMEOUT_S = 120.0  # a fresh worker must import sympy/math-verify within this (and a plug-in its module)
_WORKER_MEM_BYTES = 4 << 30  # address-space cap per worker: a runaway bignum gets MemoryError, not the OOM killer
PROGRESS_EVERY_S = 10.0  # score_rollout(progress=True) prints a line this often while checking


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
    """1.0 if the response's last boxed answer equals the gold answer per math-verify, else 0.0.

    Bounded in time: returns within about timeout_s + 1 s (after the first call, which
    also starts a worker process), from the main thread or any other thread.
    """
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
        verdict = _check(pred, gold, float(timeout_s))
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
        raise ValueError(
            f"score_responses: got {len(responses)} responses, {len(answers)} answers, {len(finished)} finished flags"
        )
    fn = _CHECKS[kind] if kind in _CHECKS else lambda response, answer: _plugin_verdict(kind, response, answer)

    def check(i: int) -> float | None:
        try:
            return fn(responses[i], answers[i])
        except Exception as e:  # noqa: BLE001 -- whatever a reward function raises, training goes on
            _report_failure(e)
            return None

    rewards = [float(truncated_reward)] * len(responses)
    todo = [i for i, done in enumerate(finished) if done]
    # math and plug-in checks mostly wait on worker processes, so keep several in flight from threads;
    # repeated (answer, gold) pairs, common within a group of samples, hit the math cache
    n_threads = min(NUM_WORKERS, len(todo)) if kind not in ("exact", "number") else 1
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

    if n_threads <= 1:
        for i in todo:
            record(i, check(i))
    else:
        with ThreadPoolExecutor(n_threads) as pool:
            futures = {pool.submit(check, i): i for i in todo}
            try:
                for future in as_completed(futures):
                    record(futures[future], future.result())
            except BaseException:  # Ctrl-C: drop the checks not yet started rather than wait for them all
                pool.shutdown(cancel_futures=True)
                raise
    failures = 0
    for i in todo:
        rewards[i] = 0.0 if verdicts[i] is None else float(verdicts[i])
        failures += verdicts[i] is None
    return rewards, failures


# as REWARD_FNS, None meaning "could not check"
_CHECKS = {"math": _math_verdict, "exact": exact_match_reward, "number": number_reward}
_reported = set()


class RewardFunctionError(Exception):
    """A plug-in reward call failed in its worker; type_name says how (the type of the exception raised there)."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def _report_failure(e: Exception) -> None:
    """One line per kind of exception and process, not one per response."""
    name = e.type_name if isinstance(e, RewardFunctionError) else type(e).__name__
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
    imports (from sys.path, then the current directory, as in the workers) and whose function is callable. The
    scripts call it before loading a model; it imports the plug-in's module into this process."""
    if kind in _CHECKS or kind in _checked_plugins:
        return
    if not _PLUGIN_RE.fullmatch(kind):
        raise ValueError(f"--reward {kind!r}: unknown reward kind; choose {', '.join(_CHECKS)} or module:function "
                         "(e.g. my_rewards:score)")
    added = [p for p in _plugin_path() if p not in sys.path]
    sys.path.extend(added)  # only while importing: the training process keeps its own import path
    try:
        _load_plugin(kind)
    except Exception as e:  # noqa: BLE001 -- whatever the module raises on import, the user gets one line
        raise ValueError(f"--reward {kind!r}: {' '.join(str(e).split())}") from None
    finally:
        for p in added:
            sys.path.remove(p)
    _checked_plugins.add(kind)


def _plugin_path() -> list[str]:
    """Where a worker looks for a plug-in's module, after its own sys.path: this process's (absolute, since the
    worker is started with -P and a relative entry means this process's cwd) and the current directory."""
    return [os.path.abspath(p) for p in sys.path] + [os.getcwd()]


def _load_plugin(spec: str):
    """The function of a "module:function" spec (in the parent, to check it; in a worker, to call it)."""
    module_name, fn_name = spec.split(":")
    importlib.invalidate_caches()  # the module may have been written after this process last imported something
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- a missing module, a SyntaxError, an error in its top-level code
        raise ImportError(f"cannot import {module_name} ({type(e).__name__}: {e})") from e
    if not hasattr(module, fn_name):
        raise AttributeError(f"module {module_name} has no attribute {fn_name}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise TypeError(f"{module_name}.{fn_name} is not callable (it is a {type(fn).__name__})")
    return fn


def _plugin_verdict(spec: str, response: str, answer: str) -> float:
    """fn(response, answer) of the plug-in, called in a worker; RewardFunctionError if the call raised, ran past
    PLUGIN_TIMEOUT_S or returned a non-number."""
    timeout_s = PLUGIN_TIMEOUT_S
    job = {"kind": "plugin", "spec": spec, "path": _plugin_path(), "response": str(response), "answer": str(answer),
           "timeout": timeout_s}
    reply = _ask(job, timeout_s + _KILL_GRACE_S, lambda r: r == "timeout" or r.startswith("{"))
    if reply is None:
        raise RewardFunctionError("WorkerKilled", f"{spec} did not return within {timeout_s:g} s, even when told "
                                  "to stop, or crashed its worker (the worker was replaced)")
    if reply == "timeout":
        raise RewardFunctionError("TimeoutError", f"{spec} did not return within {timeout_s:g} s")
    out = json.loads(reply)
    if "error" in out:
        raise RewardFunctionError(out["error"], f"{spec}: {out['message']}")
    return out["score"]


# ----------------------------------------------------------------------------
# parent side: a pool of worker processes


_idle = queue.SimpleQueue()  # workers ready for a job; one job per worker at a time
_live = set()  # every worker not yet killed, so we can clean up at exit
_live_lock = threading.Lock()
# (pred, gold) -> 1.0/0.0. The same pairs recur a lot: a group of samples per prompt, epochs.
_verdicts = {}


def _start_worker() -> subprocess.Popen:
    proc = subprocess.Popen(
        # -P: don't put common/ on the worker's sys.path, where a file named like a stdlib
        # module (common/logging.py, ...) would shadow it
        [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), os.path.abspath(__file__), "--worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,  # stderr is inherited, so a crash traceback shows up in the run's log
        text=True,
        bufsize=1,
    )
    proc.plugins = set()  # the plug-in specs this worker has imported
    with _live_lock:
        _live.add(proc)
    if _read_line(proc, _START_TIMEOUT_S) != "ready":
        _kill(proc)
        raise RuntimeError("reward worker failed to start (is math-verify installed? see stderr above)")
    return proc


def _kill(proc: subprocess.Popen) -> None:
    with _live_lock:
        _live.discard(proc)
    proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


@atexit.register
def _kill_all() -> None:
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _kill(proc)


def _forget_workers() -> None:
    # A forked child (e.g. a DataLoader worker) must not talk over its parent's pipes: it
    # closes its copies (so the workers still see EOF when the parent exits) and starts afresh.
    global _idle, _live, _live_lock
    for proc in _live:
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
    _idle, _live, _live_lock = queue.SimpleQueue(), set(), threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """One line from the worker, or None if it has not answered in time / has died."""
    # poll, unlike select, has no limit on fd numbers (big training processes open many files).
    # There is never more than one reply in flight, so Python's read buffer is empty here.
    poller = select.poll()
    poller.register(proc.stdout, select.POLLIN)
    if not poller.poll(max(0, int(timeout_s * 1000))):
        return None
    line = proc.stdout.readline()  # "" if the worker died
    return line.strip() if line.endswith("\n") else None


def _ask(job: dict, wait_s: float, valid) -> str | None:
    """Send one job to an idle worker (a fresh one if none is idle) and return its reply line, or None if it did
    not answer within wait_s or died. valid(reply) says whether the worker is in a state to be reused."""
    try:
        proc = _idle.get_nowait()
    except queue.Empty:
        proc = _start_worker()
    spec = job.get("spec")
    reply = None
    try:
        if spec is not None and spec not in proc.plugins:
            # a request of its own: the worker imports the plug-in's module untimed (it may be slow), so that
            # the call's time limit is the call's. One request at a time keeps one reply line in flight.
            reply = _send(proc, {"kind": "load", "spec": spec, "path": job["path"]}, _START_TIMEOUT_S)
            if reply != "loaded":
                return reply  # the import failed there (an error reply), or the worker is stuck or dead (None)
            proc.plugins.add(spec)
            reply = None
        reply = _send(proc, job, wait_s)
    except OSError:  # broken pipe: the worker had died
        pass
    finally:
        if reply is not None and valid(reply):
            _idle.put(proc)
        else:  # stuck, dead or confused: never reuse it
            _kill(proc)
    return reply


def _send(proc: subprocess.Popen, job: dict, wait_s: float) -> str | None:
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    return _read_line(proc, wait_s)


def _check(pred: str, gold: str, timeout_s: float) -> float | None:
    """Ask a worker whether pred == gold: 1.0 / 0.0, or None if it timed out."""
    job = {"kind": "math", "pred": pred, "gold": gold, "timeout": timeout_s}
    reply = _ask(job, timeout_s + _KILL_GRACE_S, lambda r: r in ("0", "1", "timeout"))
    return {"1": 1.0, "0": 0.0}.get(reply)


# ----------------------------------------------------------------------------
# worker side (this file run as a script)


class _CheckTimeout(BaseException):
    # BaseException, so math-verify's `except Exception` cannot swallow it and carry on
    pass


def _on_alarm(signum, frame):
    raise _CheckTimeout()


@lru_cache(maxsize=1)
def _latex_config():
    from math_verify import LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0)]


def _verify_here(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    # Wrap both sides in \boxed{} and parse them as LaTeX only: a bare "\frac12" or "2\sqrt{2}"
    # given to parse() with its default settings is not found / read as "2", and its plain-
    # expression extractor could pull a stray number out of a garbled answer. math-verify's
    # own timeouts are off (None): our SIGALRM timer bounds the whole check instead.
    config = _latex_config()
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=config, parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=config, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return verify(gold_parsed, pred_parsed, timeout_seconds=None)


_plugins = {}  # spec -> function, in a worker


def _plugin_job_here(job: dict) -> str:
    """The reply to a plug-in job: "loaded" (kind load) or the score as {"score": float} (kind plugin); else
    {"error": type name, "message": ...}, or "timeout"."""
    try:
        if job["spec"] not in _plugins:  # not timed: the parent allows for a slow import
            sys.path.extend(p for p in job["path"] if p not in sys.path)  # at the end: the stdlib is never shadowed
            _plugins[job["spec"]] = _load_plugin(job["spec"])
        if job["kind"] == "load":
            return "loaded"
        signal.setitimer(signal.ITIMER_REAL, job["timeout"])
        try:
            score = _plugins[job["spec"]](job["response"], job["answer"])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if not isinstance(score, numbers.Real):  # bool, int, float, numpy scalars
            raise TypeError(f"returned {score!r:.80} ({type(score).__name__}), not a number")
        if not math.isfinite(float(score)):
            raise ValueError(f"returned {score!r}, not a finite number")
        return json.dumps({"score": float(score)})
    except _CheckTimeout:
        return "timeout"
    except BaseException as e:  # noqa: BLE001 -- even SystemExit: the worker stays up, the call scored 0
        return json.dumps({"error": type(e).__name__, "message": " ".join(str(e).split())[:500]})


def _worker_main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we exit when our stdin closes
    # our replies go through a private copy of stdout, so stray prints can't corrupt the protocol
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # math-verify logs whole responses on timeouts/errors; that would flood the training log
    logging.getLogger("math_verify").setLevel(logging.CRITICAL + 1)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEM_BYTES, _WORKER_MEM_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    import math_verify  # noqa: F401  (pay the slow import before saying ready)

    signal.signal(signal.SIGALRM, _on_alarm)
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        reply = "0"
        try:
            job = json.loads(line)
            if job.get("kind") in ("load", "plugin"):
                out.write(_plugin_job_here(job) + "\n")
                out.flush()
                continue
            signal.setitimer(signal.ITIMER_REAL, job["timeout"])
            try:
                reply = "1" if _verify_here(job["pred"], job["gold"]) else "0"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _CheckTimeout:
            reply = "timeout"
        except BaseException:  # MemoryError, any math-verify/sympy error: not equal
            reply = "0"
        out.write(reply + "\n")
        out.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()

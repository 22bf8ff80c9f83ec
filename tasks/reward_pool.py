"""The worker processes that run the reward checks which may not return: math-verify and plug-in rewards.

Each check goes to a persistent worker (this very file run as a script, JSON lines over pipes); a SIGALRM timer in
the worker stops slow Python code, and a worker that still has not answered shortly after is killed and replaced.
Why processes, and why not multiprocessing or concurrent.futures: docs/faults.md, "Rewards that fail". This file never
imports tasks/rewards.py (a worker runs it with nothing of the repository on its import path).
"""
import atexit
import importlib
import json
import logging
import math
import numbers
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from contextlib import suppress

NUM_WORKERS = min(8, os.cpu_count() or 1)  # processes (and threads of tasks/rewards.py's score_rollout)
_KILL_GRACE_S = 1.0  # extra wait past the in-worker timer before we kill the worker
_START_TIMEOUT_S = 120.0  # a fresh worker must import sympy/math-verify within this
IMPORT_TIMEOUT_S = 60.0  # a plug-in's module must import within this, in a worker (the worker's timer, then a kill)
_WORKER_MEM_BYTES = 4 << 30  # address-space cap per worker: a runaway bignum gets MemoryError, not the OOM killer


class RewardFunctionError(Exception):
    """A plug-in reward failed in its worker; type_name says how (the type of the exception raised there)."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def check_plugin(spec: str) -> None:
    """Import the plug-in's module and find its function in a worker, as the calls will: RewardFunctionError if that
    fails or takes over IMPORT_TIMEOUT_S (never imported here: a module that hangs cannot hang the trainer)."""
    reply = _ask({"kind": "load", "spec": spec}, 0, lambda r: r == "loaded" or r[:1] == "{")
    if reply is None or reply == "import-timeout":
        raise _import_timeout(spec)
    if reply != "loaded":
        out = json.loads(reply)
        raise RewardFunctionError(out["error"], out["message"])


def _import_timeout(spec: str) -> RewardFunctionError:
    return RewardFunctionError("TimeoutError", f"importing {spec.split(':')[0]} did not finish within "
                               f"{IMPORT_TIMEOUT_S:g} s (IMPORT_TIMEOUT_S in tasks/reward_pool.py): does the "
                               "module wait on something when imported?")


def call_plugin(spec: str, response: str, answer: str, timeout_s: float) -> float:
    """fn(response, answer) of the plug-in, called in a worker; RewardFunctionError if the call raised, ran past
    timeout_s or returned a non-number."""
    job = {"kind": "plugin", "spec": spec, "response": str(response), "answer": str(answer), "timeout": timeout_s}
    reply = _ask(job, timeout_s + _KILL_GRACE_S, lambda r: r == "timeout" or r.startswith("{"))
    if reply == "import-timeout":
        raise _import_timeout(spec)
    if reply is None:
        raise RewardFunctionError("WorkerKilled", f"{spec} did not return within {timeout_s:g} s, even when told "
                                  "to stop, or crashed its worker (the worker was replaced)")
    if reply == "timeout":
        raise RewardFunctionError("TimeoutError", f"{spec} did not return within {timeout_s:g} s")
    out = json.loads(reply)
    if "error" in out:
        raise RewardFunctionError(out["error"], f"{spec}: {out['message']}")
    return out["score"]


def check_math(pred: str, gold: str, timeout_s: float) -> float | None:
    """Ask a worker whether pred == gold: 1.0 / 0.0, or None if it timed out."""
    job = {"kind": "math", "pred": pred, "gold": gold, "timeout": timeout_s}
    return {"1": 1.0, "0": 0.0}.get(_ask(job, timeout_s + _KILL_GRACE_S, lambda r: r in ("0", "1", "timeout")))


# parent side: a pool of worker processes
_idle = queue.SimpleQueue()  # workers ready for a job; one job per worker at a time
_live = set()  # every worker not yet killed, so we can clean up at exit
_live_lock = threading.Lock()


def _start_worker() -> subprocess.Popen:
    # -P: common/ is not on the worker's sys.path, where a file named like a stdlib module would shadow it; stderr is
    # inherited, so a crash traceback shows up in the run's log
    proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    proc.plugins = set()  # the plug-in specs this worker has imported
    with _live_lock:
        _live.add(proc)
    if _reply(proc, _START_TIMEOUT_S) != "ready":
        _kill(proc)
        raise RuntimeError("reward worker failed to start (is math-verify installed? see stderr above)")
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()  # (before it leaves _live: a worker in _live is never one kill_now would miss)
    with _live_lock:
        _live.discard(proc)
    proc.wait()
    _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen) -> None:
    for f in (proc.stdin, proc.stdout):
        with suppress(OSError):
            f.close()


@atexit.register
def kill_all() -> None:
    """Kill every worker (at exit; on Ctrl-C, so that the threads waiting on them return at once)."""
    global _idle
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _kill(proc)
    _idle = queue.SimpleQueue()  # the idle ones are dead now: a later job starts a fresh worker


def kill_now() -> None:
    """SIGKILL every worker, without a lock or a wait, for a process that ends at once (a second Ctrl-C, which may
    have interrupted kill_all holding its lock): else a worker mid-check outlives the trainer and prints a
    BrokenPipeError when it answers. (A worker in _live has not been waited for: its pid is still its own.)"""
    for proc in _live.copy():  # (one call under the GIL: no other thread changes the set half-way)
        with suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)


def _forget_workers() -> None:
    # A forked child (e.g. a DataLoader worker) must not talk over its parent's pipes: it
    # closes its copies (so the workers still see EOF when the parent exits) and starts afresh.
    global _idle, _live, _live_lock
    for proc in _live:
        _close_pipes(proc)
    _idle, _live, _live_lock = queue.SimpleQueue(), set(), threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _reply(proc: subprocess.Popen, wait_s: float, job: dict | None = None) -> str | None:
    """Send the job (if any), then one line from the worker, or None if it has not answered in time / has died."""
    if job is not None:
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
    # poll, unlike select, has no limit on fd numbers (big training processes open many files).
    # There is never more than one reply in flight, so Python's read buffer is empty here.
    poller = select.poll()
    poller.register(proc.stdout, select.POLLIN)
    if not poller.poll(max(0, int(wait_s * 1000))):
        return None
    line = proc.stdout.readline()  # "" if the worker died
    return line.strip() if line.endswith("\n") else None


def _ask(job: dict, wait_s: float, valid) -> str | None:
    """Send one job to an idle worker (a fresh one if none is) and return its reply line, or None if it did not answer
    within wait_s or died; valid(reply): may the worker be reused. A plug-in's job first has the worker import the
    module ("loaded", an error reply, or "import-timeout"), which a job of kind "load" asks for alone."""
    try:
        proc = _idle.get_nowait()
    except queue.Empty:
        proc = _start_worker()
    spec, reply = job.get("spec"), None
    try:
        if spec is not None and spec not in proc.plugins:
            # a request of its own (one reply line in flight) under its own time limit (the worker's timer, then our
            # deadline), so that the call's time limit is the call's. The worker looks, after its own sys.path, in
            # ours (absolute: it runs with -P, where a relative entry means our cwd), then in the current directory.
            path = [os.path.abspath(p) for p in sys.path] + [os.getcwd()]
            reply = _reply(proc, IMPORT_TIMEOUT_S + _KILL_GRACE_S,
                           {"kind": "load", "spec": spec, "path": path, "timeout": IMPORT_TIMEOUT_S})
            if reply != "loaded":
                return reply  # the import failed there (an error reply), timed out, or the worker is stuck or dead
            proc.plugins.add(spec)
        reply = None  # (until the job's reply is in: an interrupted worker is never reused)
        reply = "loaded" if job["kind"] == "load" else _reply(proc, wait_s, job)
    except OSError:  # broken pipe: the worker had died
        pass
    finally:
        if reply is not None and valid(reply):
            _idle.put(proc)
        else:  # stuck, dead or confused: never reuse it
            _kill(proc)
    return reply


# worker side (this file run as a script)
class _CheckTimeout(BaseException):
    """BaseException, so math-verify's `except Exception` cannot swallow it and carry on."""


def _on_alarm(signum, frame):
    raise _CheckTimeout()


def _timed(seconds: float, fn, *args):
    """fn(*args) with a SIGALRM timer: _CheckTimeout after `seconds`."""
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _verify_here(pred: str, gold: str) -> bool:
    from math_verify import LatexExtractionConfig, parse, verify
    # Both sides wrapped in \boxed{} and parsed as LaTeX only: parse() with its default settings misses a bare
    # "\frac12" or reads "2\sqrt{2}" as "2", and its plain-expression extractor could pull a stray number out of a
    # garbled answer. math-verify's own timeouts are off (None): our SIGALRM timer bounds the whole check instead.
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    gold_p, pred_p = (parse("\\boxed{" + s + "}", extraction_config=config, parsing_timeout=None) for s in (gold, pred))
    return bool(gold_p and pred_p) and verify(gold_p, pred_p, timeout_seconds=None)


_plugins = {}  # spec -> function, in a worker


def _load_plugin(spec: str):
    """The function of a "module:function" spec."""
    module_name, fn_name = spec.split(":")
    importlib.invalidate_caches()  # the module may have been written after this process last imported something
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- a missing module, a SyntaxError, an error in its top-level code
        raise ImportError(f"cannot import {module_name} ({type(e).__name__}: {e})") from e
    if not hasattr(module, fn_name):
        raise AttributeError(f"module {module_name} has no attribute {fn_name}")
    if not callable(fn := getattr(module, fn_name)):
        raise TypeError(f"{module_name}.{fn_name} is not callable (it is a {type(fn).__name__})")
    return fn


def _plugin_job_here(job: dict) -> str:
    """The reply to a plug-in job: "loaded" (kind load) or {"score": float} (kind plugin); else {"error": type name,
    "message": ...}, "timeout" or "import-timeout"."""
    try:
        if job["kind"] == "load":
            if job["spec"] not in _plugins:
                sys.path.extend(p for p in job["path"] if p not in sys.path)  # at the end: the stdlib is never shadowed
                try:
                    _plugins[job["spec"]] = _timed(job["timeout"], _load_plugin, job["spec"])
                except _CheckTimeout:
                    return "import-timeout"  # (the parent kills this worker: an import stopped half-way)
            return "loaded"
        score = _timed(job["timeout"], _plugins[job["spec"]], job["response"], job["answer"])
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
    with suppress(ImportError, ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEM_BYTES, _WORKER_MEM_BYTES))
    import math_verify  # noqa: F401  (pay the slow import before saying ready)

    signal.signal(signal.SIGALRM, _on_alarm)
    _say(out, "ready")
    for line in sys.stdin:
        try:
            job = json.loads(line)
            if job.get("kind") in ("load", "plugin"):
                reply = _plugin_job_here(job)
            else:
                reply = "1" if _timed(job["timeout"], _verify_here, job["pred"], job["gold"]) else "0"
        except _CheckTimeout:
            reply = "timeout"
        except BaseException:  # MemoryError, any math-verify/sympy error: not equal
            reply = "0"
        _say(out, reply)


def _say(out, line: str) -> None:
    """One line to the trainer; when the trainer is gone (killed, or ended at once, even before this worker said it
    was ready), nobody is there to answer and there is nothing to say: exit quietly."""
    try:
        out.write(line + "\n")
        out.flush()
    except BrokenPipeError:
        os._exit(0)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()

"""How a script ends (docs/faults.md, "Exit codes"): one line and an exit code for what the user can act on, a traceback
only for a bug. `__main__` is `exits.run(lambda: main(parse_args()), __file__)` (a tool: steps=False; `sys.exit(...)`
if main() returns its exit status). Ctrl-C: the first raises KeyboardInterrupt (held to a save's safe point by
SigintDeferred); a second, while the first is handled (threads joined, a save finishing, the clean-up at exit), ends
the process at once with the same line and exit code 130, after at_hard_exit's quick clean-ups: never a traceback."""
import atexit
import os
import signal
import sys
import threading
from types import SimpleNamespace

EXIT_BAD_INPUT, EXIT_FAULT, EXIT_INTERRUPTED = 2, 3, 130  # 130 = 128 + SIGINT, as a shell reports a Ctrl-C'd process

# for the line on Ctrl-C, set by the step loop and the run directory: the step in progress (0: training had not begun;
# None: a tool) and hint, () -> str: how to go on (common/rundir.py: from which checkpoint to resume; None: not known)
progress = SimpleNamespace(step=0, hint=None)
_script, _sigints, _said = "", 0, False  # run()'s script; the Ctrl-Cs its handler has seen; the line printed
_hard_exit_calls = []  # what a second Ctrl-C still does before the process ends: quick, lock-free, cannot block


def interrupted_line(script: str) -> str:
    at = "" if progress.step is None else f" at step {progress.step}"
    return f"{script}: interrupted{at}" + (progress.hint() if progress.hint else "")


def _say_interrupted() -> None:
    global _said
    if not _said:
        line = interrupted_line(_script)  # (before _said: a second Ctrl-C that cuts this short still says it)
        _said = True
        print(line, file=sys.stderr, flush=True)


def at_hard_exit(fn) -> None:
    """Have fn() called when a second Ctrl-C ends the process (os._exit: no atexit callback runs). fn must not wait
    or take a lock: it may run inside the code it would wait for (a kill of the reward workers already begun)."""
    if fn not in _hard_exit_calls:
        _hard_exit_calls.append(fn)


def _on_sigint(signum, frame):
    """The first Ctrl-C raises KeyboardInterrupt; a second ends the process now, with no clean-up (it is what is being
    interrupted) and no traceback."""
    global _sigints
    _sigints += 1
    if _sigints == 1:
        raise KeyboardInterrupt
    for fn in _hard_exit_calls:
        try:
            fn()
        except Exception:  # noqa: BLE001 -- the process ends now whatever a clean-up does
            pass
    _say_interrupted()
    os._exit(EXIT_INTERRUPTED)


def run(main, script_file: str, steps: bool = True, bad_input: tuple = ()):
    """Run main() as a script's __main__ and return its value. Bad input (ValueError, FileNotFoundError,
    PermissionError, bad_input's types): one line, exit code 2; a TrainingFault: one line, exit 3; Ctrl-C: one line,
    exit 130; anything else keeps its traceback (exit 1). DEBUG=1: every traceback. Frees the process group after."""
    global _script
    _script = os.path.basename(script_file)
    if not steps:
        progress.step = None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
        # once the interpreter's clean-up begins, a Ctrl-C changes nothing: after Python resets its handlers late in
        # that clean-up the signal would kill the process instead of letting it exit with its code
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    try:
        value, code = main(), None
    except (*_faults(), ValueError, FileNotFoundError, PermissionError, KeyboardInterrupt, *bad_input) as e:
        if os.environ.get("DEBUG"):
            raise
        value, code = None, EXIT_INTERRUPTED if isinstance(e, KeyboardInterrupt) else \
            EXIT_FAULT if isinstance(e, _faults()) else EXIT_BAD_INPUT  # (a TrainingFault: a RuntimeError)
        if code == EXIT_INTERRUPTED:
            _say_interrupted()
        else:
            print(f"{_script}: error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr, flush=True)
    # here, not inside `except`: the exception's traceback holds main()'s frames, whose model holds the process group;
    # an error exit frees it without the barrier (the other ranks need not be here)
    if "common.dist" in sys.modules:  # (a process group is set up there only)
        sys.modules["common.dist"].cleanup_distributed(barrier=code is None)
    if code is not None:
        sys.exit(code)
    return value


def _faults() -> tuple:  # (TrainingFault,) once imported, else () (none was raised): a tool is spared torch's import
    precision = sys.modules.get("common.precision")
    return (precision.TrainingFault,) if precision else ()


class SigintDeferred:
    """`with SigintDeferred() as d:` a first SIGINT is recorded (d.pending; a first Ctrl-C for run's handler), not
    raised, for code that must not stop half-way (a checkpoint's phases, collectives) and checks d.pending at a safe
    point. A second goes to the handler before (run's: the process ends). Nothing is deferred off the main thread."""

    def __enter__(self):
        self.pending, self.installed = False, threading.current_thread() is threading.main_thread()
        if self.installed:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        global _sigints
        if not self.pending:
            self.pending = True
            _sigints += self.previous is _on_sigint  # the next Ctrl-C, in this section or after it, is a second one
            return
        self.__exit__()
        signal.raise_signal(signal.SIGINT)  # to the handler before (Python's default: KeyboardInterrupt)

    def __exit__(self, *exc):
        if self.installed:
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.SIG_DFL)

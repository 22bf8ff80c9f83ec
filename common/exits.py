"""How a script ends: one line and an exit code for what the user can act on, a traceback only for a bug; a first
Ctrl-C raises KeyboardInterrupt, a second ends the process at once (docs/faults.md, "Exit codes" and "Ctrl-C")."""
import atexit
import contextlib
import os
import signal
import sys
import threading
from types import SimpleNamespace

EXIT_BAD_INPUT, EXIT_FAULT, EXIT_INTERRUPTED = 2, 3, 130  # 130 = 128 + SIGINT, as a shell reports a Ctrl-C'd process

# for the Ctrl-C line: the step in progress (0: before training; None: a tool), hint () -> str: how to go on (or None)
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
    """A first Ctrl-C raises KeyboardInterrupt; a second ends the process now, no clean-up (it is what it stops)."""
    global _sigints
    _sigints += 1
    if _sigints == 1:
        raise KeyboardInterrupt
    for fn in _hard_exit_calls:
        with contextlib.suppress(Exception):  # the process ends now whatever a clean-up does
            fn()
    _say_interrupted()
    os._exit(EXIT_INTERRUPTED)


def run(main, script_file: str, steps: bool = True, bad_input: tuple = ()):
    """main() as a script's __main__, its value returned; what the user can act on is one line and an exit code
    (docs/faults.md, "Exit codes"; bad_input: more types of bad input, exit 2). Frees the process group after."""
    global _script
    _script = os.path.basename(script_file)
    if not steps:
        progress.step = None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
        # ignored once the interpreter's clean-up begins: after Python resets its handlers SIGINT would kill the process
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
    # here, not inside `except`: the exception's traceback holds main()'s frames, whose model holds the process group
    if "common.dist" in sys.modules:  # (a process group is set up there only)
        sys.modules["common.dist"].cleanup_distributed(barrier=code is None)  # (an error: the others may not be here)
    if code is not None:
        sys.exit(code)
    return value


def _faults() -> tuple:  # (TrainingFault,) once imported, else () (none was raised): a tool is spared torch's import
    precision = sys.modules.get("common.precision")
    return (precision.TrainingFault,) if precision else ()


class SigintDeferred:
    """`with SigintDeferred() as d:` a first SIGINT sets d.pending (counted as run's first Ctrl-C), not raised, for code
    that must not stop half-way, to check at a safe point; a second goes to the handler before. Main thread only."""

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

"""How a script ends: one line and an exit code for what the user can act on, a traceback only for a bug
(docs/faults.md, "Exit codes"). A script's `__main__` is

    exits.run(lambda: main(parse_args()), __file__)

and its step loop sets `exits.progress.step` (the step in progress) and `exits.progress.ckpt_root` (where its
checkpoints go), which the message on Ctrl-C names.

Ctrl-C: the first SIGINT raises KeyboardInterrupt where the run is (inside a checkpoint save it is held until the
save's next safe point: common/checkpoint.py, and counted as the first); a second one, while the first is still being
handled (threads joined, workers killed, a save finishing, the clean-up at exit), ends the process at once with the
same one line and exit code 130, after the quick clean-ups registered with at_hard_exit (the reward workers killed):
an interrupt is never turned into a traceback or another error by the clean-up it interrupts.
"""
import atexit
import os
import signal
import sys
import threading

from common.precision import TrainingFault

EXIT_BAD_INPUT, EXIT_FAULT, EXIT_INTERRUPTED = 2, 3, 130  # 130 = 128 + SIGINT, as a shell reports a Ctrl-C'd process


class Progress:
    """Where the run is, for the message on Ctrl-C."""
    step = 0  # the step in progress (0: training had not begun)
    ckpt_root: str | None = None  # the run's checkpoints/ (None: not known yet)


progress = Progress()
_said = False  # the one line on Ctrl-C is printed once, whichever path prints it


def interrupted_line(script: str) -> str:
    """`<script>: interrupted at step N; ...` and how to go on: --resume latest when a checkpoint exists to resume
    from, else that there is none (a --resume latest would fail)."""
    from common.checkpoint import checkpoint_step, list_checkpoints  # (common.checkpoint imports this module)
    line = f"{script}: interrupted at step {progress.step}"
    if progress.ckpt_root is None:
        return line
    found = list_checkpoints(progress.ckpt_root)
    if found:
        return f"{line}; resume with --resume latest (step {checkpoint_step(found[-1])})"
    return f"{line}, before the run's first checkpoint: nothing to resume; start it again with --overwrite"


def _say_interrupted(script: str) -> None:
    global _said
    if not _said:
        line = interrupted_line(script)  # (before _said: a second Ctrl-C that cuts this short still says it)
        _said = True
        print(line, file=sys.stderr, flush=True)


_hard_exit_calls = []  # what a second Ctrl-C still does before the process ends: quick, lock-free, cannot block


def at_hard_exit(fn) -> None:
    """Have fn() called when a second Ctrl-C ends the process at once (os._exit: no atexit callback runs then). fn
    must not wait or take a lock: it may run inside the very code it would wait for (e.g. a kill of the reward
    workers that the first Ctrl-C had begun)."""
    if fn not in _hard_exit_calls:
        _hard_exit_calls.append(fn)


class _Interrupts:
    """The SIGINT handler of a script's run: the first Ctrl-C raises KeyboardInterrupt, a second one (the user
    insists, or presses again while the first is handled) ends the process at once. A Ctrl-C held by SigintDeferred
    counts as a first one (count_held): the next one is the second, whether during the save or after it."""

    def __init__(self, script: str):
        self.script, self.count = script, 0

    def __call__(self, signum, frame):
        self.count += 1
        if self.count == 1:
            raise KeyboardInterrupt
        # a second Ctrl-C while the first unwinds: no clean-up (it is what is being interrupted), no traceback
        for fn in _hard_exit_calls:
            try:
                fn()
            except Exception:  # noqa: BLE001 -- the process ends now whatever a clean-up does
                pass
        _say_interrupted(self.script)
        os._exit(EXIT_INTERRUPTED)


def count_held(handler) -> None:
    """A Ctrl-C was held (SigintDeferred) while `handler` was the SIGINT handler: when that is a run's (_Interrupts),
    it counts as the first, so that the next Ctrl-C ends the process at once rather than raise again."""
    if isinstance(handler, _Interrupts):
        handler.count += 1


def run(main, script_file: str) -> None:
    """Run main() as a script's __main__: bad input (ValueError, FileNotFoundError, PermissionError) is one line and
    exit code 2, a TrainingFault one line and exit code 3, Ctrl-C one line and exit code 130; anything else is a bug
    or an environment problem and keeps its traceback (exit code 1). DEBUG=1: every traceback. After main() returns,
    the process group is freed here (main's model holds it)."""
    from common.dist import cleanup_distributed
    script = os.path.basename(script_file)
    debug = bool(os.environ.get("DEBUG"))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _Interrupts(script))
        # once the interpreter's own clean-up begins (atexit: workers killed, ...), a Ctrl-C changes nothing: the exit
        # is under way, and after Python resets its handlers late in that clean-up the signal would kill the process
        # instead of letting it exit with its code
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    try:
        main()
    except TrainingFault as e:  # (a RuntimeError: before the generic handlers below)
        if debug:
            raise
        print(f"{script}: error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAULT)
    except (ValueError, FileNotFoundError, PermissionError) as e:
        if debug:
            raise
        print(f"{script}: error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        if debug:
            raise
        _say_interrupted(script)
        sys.exit(EXIT_INTERRUPTED)
    cleanup_distributed()


def one_line(e: BaseException) -> str:
    """The message of e on one line (a message that spans lines is joined: the rule is one line per error)."""
    return " ".join(str(e).split()) or type(e).__name__


class SigintDeferred:
    """`with SigintDeferred() as d:` a first SIGINT inside is recorded (d.pending) instead of raised, so that code
    which must not stop half-way (a checkpoint's phases, its rename, the collectives every rank must join) reaches a
    point where it can stop cleanly and checks d.pending there; the run's handler counts it as a first Ctrl-C. A
    second SIGINT goes to the handler that was there before (the user insists: under a run's handler, the process
    ends now). Outside the main thread (no signal handler can be set there) nothing is deferred and pending stays
    False."""

    def __enter__(self):
        self.pending, self.installed = False, threading.current_thread() is threading.main_thread()
        if self.installed:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if not self.pending:
            self.pending = True
            count_held(self.previous)  # the next Ctrl-C, in this section or after it, is a second one
            return
        signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.SIG_DFL)
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous in (signal.SIG_DFL, None):
            os.kill(os.getpid(), signal.SIGINT)

    def __exit__(self, *exc):
        if self.installed:
            signal.signal(signal.SIGINT, self.previous if self.previous is not None else signal.SIG_DFL)
        return False

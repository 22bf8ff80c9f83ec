"""Runs an algorithm script as its own `__main__` would run (its exit path included), then reports the gloo threads
still alive in this process, for tests/test_exit.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/exit_check.py OUT_DIR SCRIPT [args...]

Each rank writes OUT_DIR/rank<r>.json: {"gloo_threads": [names], "code": the script's exit code}; SCRIPT may be
tests/fault_injection.py with its own arguments (an error exit). A gloo thread alive once the script is done belongs
to a process group that is destroyed but still referenced; it is freed at the interpreter's teardown, which can
abort the finished process ("terminate called without an active exception", torchrun exit -6)."""
import glob
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def gloo_threads() -> list[str]:
    """The names (Linux: /proc/self/task/*/comm) of this process's threads that gloo started."""
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo")))


if __name__ == "__main__":
    out, script, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank = os.environ["RANK"]
    sys.argv = [script, *argv]
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        code = 0
    except SystemExit as e:  # an error exit (the script's own exit code), recorded with the threads left after it
        code = e.code
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"gloo_threads": gloo_threads(), "code": code}, f)

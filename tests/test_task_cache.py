"""tasks/cache.py: build once into the cache, under a lock, atomically; the one helper behind every task's files."""
import glob
import os
import subprocess
import sys

import pytest

from tasks.cache import MARKER, build_once, ensure_problem_splits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def writer(calls, content="x"):
    def build(tmp):
        calls.append(tmp)
        with open(os.path.join(tmp, "data.txt"), "w") as f:
            f.write(content)
    return build


def test_builds_once_and_leaves_no_temporary(tmp_path):
    calls, out = [], str(tmp_path / "task")
    os.makedirs(out + ".tmp999")  # left by a killed build
    assert build_once(out, writer(calls)) == out
    assert build_once(out, writer(calls)) == out  # complete: not built again
    assert len(calls) == 1 and sorted(os.listdir(out)) == [MARKER, "data.txt"]
    assert not glob.glob(out + ".tmp*")


# Two processes race on a fresh directory (as torchrun's ranks do on a first run): the build sleeps, so the second one
# usually finds the lock taken; whichever order they run in, one builds and both return the complete directory.
RACER = """
import os, sys, time
from tasks.cache import build_once
def build(tmp):
    print("building", flush=True)
    time.sleep(2)
    with open(os.path.join(tmp, "data.txt"), "w") as f:
        f.write(str(os.getpid()))
print("DIR=" + build_once(sys.argv[1], build))
"""


def test_concurrent_callers_build_once(tmp_path):
    out = str(tmp_path / "task")
    procs = [subprocess.Popen([sys.executable, "-c", RACER, out], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(o.count("building") for o in outs) == 1, outs
    assert all(f"DIR={out}" in o.splitlines() for o in outs), outs
    assert sorted(os.listdir(out)) == [MARKER, "data.txt"] and not glob.glob(out + ".tmp*")
    with open(os.path.join(out, "data.txt")) as f:
        assert int(f.read()) in [p.pid for p in procs]


def test_a_failed_build_leaves_nothing_taken_as_done(tmp_path):
    out = str(tmp_path / "task")

    def broken(tmp):
        writer([])(tmp)
        raise RuntimeError("killed halfway")
    with pytest.raises(RuntimeError):
        build_once(out, broken)
    assert not os.path.exists(out) and not glob.glob(out + ".tmp*")
    calls = []
    build_once(out, writer(calls))
    assert len(calls) == 1  # the next caller builds it


def test_an_older_build_is_replaced_but_not_a_directory_of_other_files(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "data.txt").write_text("from an older version, no marker")
    build_once(str(old), writer([], "new"))
    assert (old / "data.txt").read_text() == "new"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("keep me")
    with pytest.raises(FileExistsError, match="notes.md"):
        build_once(str(mine), writer([]))
    assert (mine / "notes.md").read_text() == "keep me" and not (mine / MARKER).exists()


def test_problem_splits_are_seeded_and_disjoint(tmp_path):
    def make(n, rng, exclude=()):
        out = []
        while len(out) < n:
            p = {"problem": str(rng.randint(0, 99)), "answer": "0"}
            if p["problem"] not in exclude and p not in out:
                out.append(p)
        return out
    a = ensure_problem_splits(str(tmp_path / "a"), make, 20, 10, seed=3)
    b = ensure_problem_splits(str(tmp_path / "b"), make, 20, 10, seed=3)
    assert [open(a[k]).read() for k in ("train", "eval")] == [open(b[k]).read() for k in ("train", "eval")]
    train, evals = ({line for line in open(a[k])} for k in ("train", "eval"))
    assert len(train) == 20 and len(evals) == 10 and not train & evals

"""Build once into the cache: the one mechanism behind every task's files (the built-in task, the word problems, the
multi-step problems, a converted real model).

A build writes into a temporary directory beside its place (`<dir>.tmp<pid>`), ends with a marker file, and is renamed
into place: readers see nothing or a complete directory, and an interrupted build leaves nothing that a later caller
takes as done (the next build deletes the leftover). A file lock beside it (`<dir>.lock`) makes concurrent callers
(torchrun ranks, CI jobs) wait while one of them builds.
"""
import fcntl
import glob
import json
import os
import random
import shutil
from typing import Callable

MARKER = "BUILD_COMPLETE"  # written last: its presence means the directory is complete


def cache_dir(version: str, env_var: str) -> str:
    """Where a task is cached: $<env_var> when set, else ~/.cache/rl-mismatch/<version>."""
    return os.path.abspath(os.path.expanduser(
        os.environ.get(env_var) or os.path.join("~", ".cache", "rl-mismatch", version)))


def build_once(out_dir: str, build: Callable[[str], None]) -> str:
    """out_dir, complete: when its marker is missing, build(tmp) writes the contents into a temporary directory that
    then replaces out_dir, all under the lock. A directory already at out_dir without the marker (a build of an older
    version) is replaced only when it holds nothing but names the new build wrote: never a directory of other files.
    Returns out_dir (absolute)."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    marker = os.path.join(out_dir, MARKER)
    if os.path.exists(marker):
        return out_dir
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    with open(out_dir + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(marker):  # another process built it while we waited
            return out_dir
        for stale in glob.glob(glob.escape(out_dir) + ".tmp*"):  # left by a killed build: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = f"{out_dir}.tmp{os.getpid()}"
        os.makedirs(tmp)
        try:
            build(tmp)
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write("ok\n")
            if os.path.isdir(out_dir):
                strays = sorted(set(os.listdir(out_dir)) - set(os.listdir(tmp)))
                if strays:
                    raise FileExistsError(f"{out_dir} holds files that are not this build's ({', '.join(strays[:3])}"
                                          f"{', ...' if len(strays) > 3 else ''}): choose another directory")
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def distinct_problems(make_problem: Callable, n: int, rng: random.Random, exclude=()) -> list[dict]:
    """n problems from make_problem(rng) with distinct texts, none of them in exclude."""
    seen, out = set(exclude), []
    while len(out) < n:
        p = make_problem(rng)
        if p["problem"] not in seen:
            seen.add(p["problem"])
            out.append(p)
    return out


def ensure_problem_splits(out_dir: str, make_problems: Callable, n_train: int, n_eval: int, seed: int) -> dict:
    """train.jsonl and eval.jsonl of a generated task, built once into out_dir: n_train then n_eval problems from one
    generator seeded with `seed` (the same files on every machine), the evaluation ones disjoint from the training
    ones. make_problems(n, rng, exclude) returns n problems with distinct texts, none in exclude."""
    def build(tmp: str) -> None:
        rng = random.Random(seed)
        train = make_problems(n_train, rng)
        write_jsonl(os.path.join(tmp, "train.jsonl"), train)
        write_jsonl(os.path.join(tmp, "eval.jsonl"), make_problems(n_eval, rng, exclude={p["problem"] for p in train}))
    out_dir = build_once(out_dir, build)
    return {"train": os.path.join(out_dir, "train.jsonl"), "eval": os.path.join(out_dir, "eval.jsonl")}

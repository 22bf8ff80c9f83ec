"""Runs the repository's scripts on command lines that end soon (bad input that must end before any model loads, a
tool that only reads and writes files), one after another in this one process: one start of torch and transformers
for all of them, where a process each took about 10 s of a 2-core CPU. early_exits(cases, tmp, env) runs

    python tests/early_exit.py CASES_JSON OUT_JSON

CASES_JSON: a list of [script, [args...]] (script: its path from the repository's root). Each runs as `python
script args...` from the repository's root would (runpy: the file run as __main__ with that sys.argv; the exit code
is SystemExit's), its output captured at the file descriptors 1 and 2 (every writer, whatever stream object it
holds). OUT_JSON: a list of {"code", "stdout", "stderr"}, in the order of the cases; an exception that escapes is
printed with its traceback and exit code 1, as the interpreter does."""
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_case(script: str, args: list[str]) -> dict:
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile(mode="w+b") for fd in (1, 2)}
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, f in files.items():
        os.dup2(f.fileno(), fd)
    sys.argv = [script, *args]
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)  # (sys.exit("message"): the interpreter prints it)
    except BaseException:  # noqa: BLE001  (what the interpreter does with it: the traceback, exit 1)
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
    out = {}
    for fd, name in ((1, "stdout"), (2, "stderr")):
        files[fd].seek(0)
        out[name] = files[fd].read().decode(errors="replace")
        files[fd].close()
    return {"code": code, **out}


def early_exits(cases, tmp: str, env: dict) -> list[subprocess.CompletedProcess]:
    """[(script, args)] run in one process of this file (files in tmp): a result a case, with .returncode, .stdout and
    .stderr as subprocess.run gives them."""
    cases_file, out_file = os.path.join(tmp, "early_cases.json"), os.path.join(tmp, "early_results.json")
    with open(cases_file, "w") as f:
        json.dump([[name, list(args)] for name, args in cases], f)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), cases_file, out_file], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(out_file) as f:
        return [subprocess.CompletedProcess([name, *args], r["code"], r["stdout"], r["stderr"])
                for (name, args), r in zip(cases, json.load(f))]


if __name__ == "__main__":
    cases_file, out_file = sys.argv[1:3]  # (each case sets sys.argv)
    with open(cases_file) as f:
        cases = json.load(f)
    results = [run_case(script, args) for script, args in cases]
    with open(out_file, "w") as f:
        json.dump(results, f)

"""A fork is one file (docs/forking.md): in a copy of the repository's tracked files, grpo.py copied to my_algo.py
with one marked line added is run by the tests that take the discovered list of scripts (conftest.SCRIPTS) and is
taken by sanity/run_sanity.py --algorithms, with no list edited. A selection of those tests runs (the in-process
checks of the command line and one subprocess), on my_algo.py, and each of their functions that runs on grpo.py runs
on it too. Every script has its section in docs/algorithms.md."""
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
# the tests run in the copy: the fast ones of the files whose tests take SCRIPTS (a run of the script's training loop
# takes minutes: those are in the same lists, and test_wiring shows it)
FILES = ["tests/test_bad_input.py", "tests/test_config.py", "tests/test_dist.py"]
SELECT = "validate or group or exits_2_before or preset or gloo"


def copy_checkout(dest: str) -> None:
    """The repository's tracked files (git ls-files), as a fresh clone would have them, into dest."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for path in filter(None, files.split("\0")):
        src = os.path.join(ROOT, path)
        if os.path.isfile(src):  # (a file deleted but not yet committed is still listed)
            os.makedirs(os.path.join(dest, os.path.dirname(path)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, path))


def fork(root: str) -> None:
    """my_algo.py: grpo.py with one harmless line, marked as a fork marks what it adds."""
    with open(os.path.join(root, "grpo.py")) as f:
        text = f.read()
    anchor = "\ndef validate("
    assert text.count(anchor) == 1
    text = text.replace(anchor, "\n# MY_ALGO: a fork of grpo.py; this line is all that differs\n" + anchor[1:])
    with open(os.path.join(root, "my_algo.py"), "w") as f:
        f.write(text)


def ran(junit_xml: str) -> dict[str, str]:
    """{test id: outcome} from pytest's JUnit XML report."""
    out = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        out[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return out


def function(test_id: str) -> str:
    """tests.test_x::test_y[params] -> tests.test_x::test_y"""
    return test_id.split("[")[0]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_has_its_section_in_the_algorithms_page(name):
    """A script's math is written down (docs/forking.md, step 3): docs/algorithms.md has a section `## NAME.py: ...`
    and the contents line links it."""
    with open(os.path.join(ROOT, "docs", "algorithms.md"), encoding="utf-8") as f:
        text = f.read()
    assert f"\n## {name}: " in text, f"docs/algorithms.md has no section '## {name}: ...'"
    assert f"[{name}](#{name.replace('.', '')}" in text.split("\n## ")[0]


def test_a_copy_of_grpo_is_in_the_tests_and_the_sanity_run(tmp_path):
    root = str(tmp_path / "checkout")
    copy_checkout(root)
    assert not os.path.exists(os.path.join(root, "my_algo.py"))
    fork(root)
    report = str(tmp_path / "report.xml")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES, "-k",
                        f"my_algo and ({SELECT})", f"--junitxml={report}"], cwd=root, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    results = ran(report)
    assert results and all("my_algo" in t for t in results) and set(results.values()) == {"passed"}, results
    # every test function of the selection that runs on grpo.py ran on my_algo.py
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *FILES,
                        "-k", f"grpo and ({SELECT})"], cwd=root, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    on_grpo = {function(line.replace("/", ".").replace(".py::", "::")) for line in p.stdout.splitlines()
               if "::" in line}
    assert len(on_grpo) >= 6 and on_grpo == {function(t) for t in results}, (on_grpo, sorted(results))
    # the sanity run takes it by name (and refuses a name that is no script)
    check = ("import sys; from sanity.run_sanity import parse_args, validate\n"
             "validate(parse_args(['--algorithms', 'grpo', 'my_algo']))\n"
             "try:\n    validate(parse_args(['--algorithms', 'my_algo2']))\nexcept ValueError as e:\n    print(e)")
    p = subprocess.run([sys.executable, "-c", check], cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("--algorithms my_algo2: no such algorithm script") and "my_algo," in p.stdout

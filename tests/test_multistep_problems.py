"""The multi-step word problems (tasks/multistep_problems.py): fixed, disjoint, every answer recomputed from the
chain with exact fractions, every operand told in the text, a spread of 2..6 steps, and `--reward math` accepting
the answer in a \\boxed{}."""
import collections
import json
import math
import random
import re
from fractions import Fraction

from tasks.data import load_problems
from tasks.multistep_problems import MAX_STEPS, MIN_STEPS, N_EVAL, N_TRAIN, SEED, ensure_multistep_problems, \
    make_problems
from tasks.rewards import math_reward


def recompute(chain: list) -> Fraction:
    """The answer from the chain's operations alone, in exact rational arithmetic; each step's stated value must be
    what the operation gives, and a whole number."""
    (start, v), = [chain[0][:2]]
    assert start == "start"
    v = Fraction(v)
    for op, *operands, stated in chain[1:]:
        b = Fraction(operands[0])
        if op == "add":
            v = v + b
        elif op == "sub":
            v = v - b
        elif op == "times":
            v = v * b
        elif op == "divide":
            v = v / b
        elif op == "fraction_off":
            v = v * (1 - Fraction(operands[0], operands[1]))
        elif op == "percent_up":
            v = v * (1 + b / 100)
        elif op == "percent_off":
            v = v * (1 - b / 100)
        elif op == "pack_full":
            v = Fraction(math.floor(v / b))
        elif op == "pack_left":
            v = v - b * math.floor(v / b)
        else:
            raise AssertionError(f"unknown op {op}")
        assert v.denominator == 1 and v > 0 and v == stated, (op, operands, v, stated)
    return v


def operand_text(op: str, operands: list) -> str:
    """How an operation's operand is written in its sentence."""
    if op == "fraction_off":
        return f"{operands[0]}/{operands[1]}"
    if op in ("percent_up", "percent_off"):
        return f"{operands[0]}%"
    return str(operands[0])


def test_files_are_fixed_disjoint_and_right(tmp_path):
    paths = ensure_multistep_problems(str(tmp_path / "a"))
    rows = {k: [json.loads(line) for line in open(p)] for k, p in paths.items()}
    assert len(rows["train"]) == N_TRAIN and len(rows["eval"]) == N_EVAL
    assert not {r["problem"] for r in rows["train"]} & {r["problem"] for r in rows["eval"]}
    assert rows["train"][:5] == make_problems(5, random.Random(SEED))  # a fixed seed: the same files everywhere
    again = ensure_multistep_problems(str(tmp_path / "b"))
    assert all(open(paths[k]).read() == open(again[k]).read() for k in paths)
    # the loader the scripts use reads them (the extra fields are dropped)
    assert load_problems(paths["eval"])[0] == {"problem": rows["eval"][0]["problem"], "answer": rows["eval"][0]["answer"]}
    for r in rows["train"] + rows["eval"]:
        assert r["answer"] == str(recompute(r["chain"])), r
        assert len(r["chain"]) == r["steps"] + 1 and MIN_STEPS <= r["steps"] <= MAX_STEPS
        assert 10 <= r["chain"][0][1] <= 9999  # a 2-4 digit start
        # one sentence for the start, one per step, one question; each states its operand ("1000" of a change of
        # unit is implied by the unit's name)
        sentences = re.split(r"(?<=[.?])\s+", r["problem"])
        assert len(sentences) == r["steps"] + 2 and sentences[-1].endswith("?"), r["problem"]
        assert str(r["chain"][0][1]) in sentences[0]
        for (op, *operands, _), s in zip(r["chain"][1:], sentences[1:-1]):
            unit_change = "written in" in s or "counted in" in s
            assert unit_change or operand_text(op, operands) in s, (op, operands, s)


def test_a_spread_of_steps_and_operations(tmp_path):
    rows = [json.loads(line) for line in open(ensure_multistep_problems(str(tmp_path))["train"])]
    steps = collections.Counter(r["steps"] for r in rows)
    assert sorted(steps) == list(range(MIN_STEPS, MAX_STEPS + 1))
    assert min(steps.values()) > 0.15 * N_TRAIN  # about uniform: 1/5 each
    ops = collections.Counter(c[0] for r in rows for c in r["chain"][1:])
    assert set(ops) == {"add", "sub", "times", "divide", "fraction_off", "percent_up", "percent_off", "pack_full",
                        "pack_left"}
    assert min(ops.values()) > 50, ops


def test_the_math_reward_accepts_the_boxed_answer(tmp_path):
    rows = [json.loads(line) for line in open(ensure_multistep_problems(str(tmp_path))["eval"])]
    for r in rows[:20]:
        a = r["answer"]
        assert math_reward(f"Step by step ... so the total is {a}.\n\n\\boxed{{{a}}}", a) == 1.0, a
        assert math_reward(f"\\boxed{{{int(a) + 1}}}", a) == 0.0, a
        assert math_reward(f"The answer is {a}.", a) == 0.0  # no \boxed{}: the R1 instruction asks for one

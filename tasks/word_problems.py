"""A real-model task: one-step arithmetic word problems that a small pretrained chat model solves sometimes.

SmolLM2-135M-Instruct (tasks/real_model.py) answers "What is a + b?" in a sentence ("7 + 5 is equal to 12.") and is
right in about 10-30% of its samples at temperature 1 on small operands; the four operations and the story templates
below spread the problems over a range of difficulties, so that the perfectible builder (sanity/build_perfectible.py)
finds problems in its [0.2, 0.8] band. Answers are non-negative integers; the `number` reward (the response's final
number) scores them.

    python -m tasks.word_problems                  # writes the files (if missing) and prints their paths
    paths = ensure_word_problems()                  # {"train": jsonl, "eval": jsonl}

Generated from a fixed seed: the same files on every machine; evaluation problems are disjoint from training ones.
"""
import random
import sys

from tasks.cache import cache_dir, distinct_problems, ensure_problem_splits

VERSION = "word-problems-v1"
N_TRAIN, N_EVAL = 2000, 200
SEED = 2026

NAMES = ["Tom", "Sara", "Ben", "Mia", "Leo", "Anna", "Sam", "Lily", "Max", "Emma", "Jack", "Zoe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "balloons", "shells", "cards"]
CONTAINERS = ["box", "bag", "jar", "basket", "packet"]

# (operation, template); {n}: a name, {it}: items, {c} / {cs}: a container / its plural, {a} and {b}: the
# operands, {p}: a * b (the dividend of a division whose answer is a)
TEMPLATES = [
    ("+", "What is {a} + {b}?"),
    ("+", "{n} has {a} {it}. {n} buys {b} more {it}. How many {it} does {n} have now?"),
    ("+", "There are {a} {it} on a table and {b} {it} on a shelf. How many {it} are there in all?"),
    ("-", "What is {a} - {b}?"),
    ("-", "{n} had {a} {it} and gave {b} of them to a friend. How many {it} does {n} have left?"),
    ("-", "A {c} held {a} {it}. {n} took {b} {it} out of it. How many {it} are still in the {c}?"),
    ("*", "What is {a} times {b}?"),
    ("*", "A {c} holds {a} {it}. How many {it} are in {b} {cs}?"),
    ("/", "What is {p} divided by {b}?"),
    ("/", "{n} shares {p} {it} equally among {b} friends. How many {it} does each friend get?"),
]


def make_problem(rng: random.Random) -> dict:
    op, template = rng.choice(TEMPLATES)
    if op in "+-":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        if op == "-" and b > a:
            a, b = b, a
        answer = a + b if op == "+" else a - b
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        answer = a * b if op == "*" else a
    c = rng.choice(CONTAINERS)
    text = template.format(a=a, b=b, p=a * b, n=rng.choice(NAMES), it=rng.choice(ITEMS), c=c,
                           cs="boxes" if c == "box" else c + "s")
    return {"problem": text, "answer": str(answer), "op": op}


def make_problems(n: int, rng: random.Random, exclude=()) -> list[dict]:
    """n problems with distinct texts, none of them in exclude."""
    return distinct_problems(make_problem, n, rng, exclude)


def ensure_word_problems(out_dir: str | None = None) -> dict:
    """train.jsonl / eval.jsonl, written once into out_dir (default: the cache or $WORD_PROBLEMS_DIR);
    returns their paths."""
    out_dir = out_dir or cache_dir(VERSION, "WORD_PROBLEMS_DIR")
    return ensure_problem_splits(out_dir, make_problems, N_TRAIN, N_EVAL, SEED)


if __name__ == "__main__":
    p = ensure_word_problems(sys.argv[1] if len(sys.argv) > 1 else None)
    print(p["train"])
    print(p["eval"])

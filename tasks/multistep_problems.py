"""A real-model task with room for chain-of-thought: multi-step arithmetic word problems.

Qwen2.5 Coder 1.5B Instruct (tasks/real_model.py) solves the one-step word problems (tasks/word_problems.py) 88%
of the time at the start of training, so nothing there can still be learned. Here one quantity goes through a chain of
2 to 6 operations told as a story (a shop's stock that is sold, packed into boxes, priced, weighed, taxed, ...):
additions and subtractions of 2-3 digit numbers to a 2-4 digit start, products, fractions ("gives away 3/8 of
them"), percentages ("grows by 15%"), whole-box divisions and their remainders, and unit changes (kilograms to grams,
minutes to hours, items to dollars). Every intermediate value is a whole number (the operands are drawn so), the
answer is the last one. The number of steps is drawn uniformly from MIN_STEPS..MAX_STEPS, so that the problems spread
from nearly always to nearly never solved, and a perfectible set ([0.2, 0.8] success at k >= 16) can be taken out of
a few thousand of them (sanity/build_perfectible.py). Asked with the R1 instruction (`--prompt-template chat`) and
scored with `--reward math` (the last \\boxed{}).

    python -m tasks.multistep_problems             # writes the files (if missing) and prints their paths
    paths = ensure_multistep_problems()             # {"train": jsonl, "eval": jsonl}

Each row: {"problem", "answer", "steps" (the number of operations), "chain" ([op, operands..., value after] for each
step, the first being ["start", value]; ops: add, sub, times, divide (exact), fraction_off (v - v p/q), percent_up,
percent_off, pack_full (whole boxes: v // b), pack_left (the rest: v % b)): the chain lets a test recompute the
answer}. Generated from a fixed seed:
the same files on every machine; evaluation problems are disjoint from training ones.
"""
import math
import random
import sys

from tasks.cache import cache_dir, distinct_problems, ensure_problem_splits

VERSION = "multistep-problems-v1"
N_TRAIN, N_EVAL = 4000, 300
SEED = 2027
MIN_STEPS, MAX_STEPS = 2, 6
MAX_VALUE = 999_999  # no intermediate value above this: products stay readable

NAMES = ["Tom", "Sara", "Ben", "Mia", "Leo", "Anna", "Sam", "Lily", "Max", "Emma", "Jack", "Zoe", "Omar", "Nina"]
PLACES = ["a bakery", "a toy shop", "a farm", "a bookshop", "a workshop", "a warehouse", "a market stall", "a factory"]
ITEMS = ["apples", "pencils", "cookies", "marbles", "books", "candles", "bottles", "shirts", "toys", "eggs", "jars"]
CONTAINERS = [("box", "boxes"), ("crate", "crates"), ("bag", "bags"), ("basket", "baskets"), ("carton", "cartons")]
FRACTIONS = [(p, q) for q in range(2, 13) for p in range(1, q) if math.gcd(p, q) == 1]
PERCENTS = [5, 10, 15, 20, 25, 30, 40, 50, 60, 75]


# ----------------------------------------------------------------------------------------------------------------
# The steps. A state is (value, kind, noun): kind says what the value counts (items, containers, dollars, grams,
# kilograms, minutes, hours), noun names it in the story. Each step function returns None where it cannot apply
# with whole numbers, else (new state, sentence, [op, operands...]).

def _add(rng, v, kind, noun, n):
    b = rng.randint(10, 99) if kind in ("containers", "hours") else rng.randint(10, 999)
    if v + b > MAX_VALUE:
        return None
    text = {"items": f"{n} gets {b} more {noun}.", "containers": f"{n} gets {b} more {noun}.",
            "dollars": f"{n} earns {b} more dollars.", "grams": f"{n} adds {b} grams of wrapping.",
            "kilograms": f"{n} adds {b} more kilograms.", "minutes": f"{n} adds {b} minutes for cleaning up.",
            "hours": f"{n} works {b} more hours."}[kind]
    return (v + b, kind, noun), text, ["add", b]


def _sub(rng, v, kind, noun, n):
    if v < 12:
        return None
    b = rng.randint(10, min(999, v - 2))
    text = {"items": f"{n} sells {b} of the {noun}.", "containers": f"{b} of the {noun} are sent away.",
            "dollars": f"{n} spends {b} dollars on supplies.", "grams": f"{b} grams are lost.",
            "kilograms": f"{b} kilograms are used up.", "minutes": f"A helper saves {n} {b} minutes.",
            "hours": f"{n} takes {b} of those hours off."}[kind]
    return (v - b, kind, noun), text, ["sub", b]


def _fraction(rng, v, kind, noun, n):
    if kind not in ("items", "containers", "dollars"):
        return None
    fits = [(p, q) for p, q in FRACTIONS if v % q == 0]
    if not fits:
        return None
    p, q = rng.choice(fits)
    # v1's wording, which the 1.5B experiment ran on (sanity/results/cot_1.5b): changing a sentence changes the task,
    # so a new wording needs a new VERSION
    text = {"items": f"{n} gives away {p}/{q} of the {noun}.", "containers": f"{p}/{q} of the {noun} are sold.",
            "dollars": f"{n} spends {p}/{q} of the money."}[kind]
    return (v - v * p // q, kind, noun), text, ["fraction_off", p, q]


def _percent(rng, v, kind, noun, n):
    if kind not in ("items", "containers", "dollars"):
        return None
    ps = [p for p in PERCENTS if v * p % 100 == 0]
    if not ps:
        return None
    p, up = rng.choice(ps), rng.random() < 0.5
    new = v + v * p // 100 if up else v - v * p // 100
    if new > MAX_VALUE:
        return None
    if kind == "dollars":
        text = f"{n}'s money grows by {p}%." if up else f"{n} pays {p}% of the money in tax."
    else:
        text = f"The number of {noun} grows by {p}%." if up else f"{p}% of the {noun} are damaged and thrown away."
    return (new, kind, noun), text, ["percent_up" if up else "percent_off", p]


def _pack(rng, v, kind, noun, n):
    """items -> the full containers (whole-number division), or the items left over (the remainder)."""
    if kind != "items":
        return None
    b = rng.randint(3, 60)
    c, cs = rng.choice(CONTAINERS)
    if v // b < 2:
        return None
    if rng.random() < 0.6:
        return (v // b, "containers", cs), (f"{n} packs the {noun} into {cs} of {b} each and keeps only the full "
                                            f"{cs}."), ["pack_full", b]
    if v % b < 2:
        return None
    return (v % b, "items", noun), (f"{n} packs the {noun} into {cs} of {b} each; only the {noun} that do not fill a "
                                    f"whole {c} stay with {n}."), ["pack_left", b]


def _per_unit(rng, v, kind, noun, n):
    """A product that changes what is counted: containers -> items or kilograms, items -> dollars, grams or minutes,
    hours -> dollars."""
    if kind == "containers":
        if rng.random() < 0.5:
            it = rng.choice(ITEMS)
            b = rng.randint(4, 48)
            new, text = (v * b, "items", it), f"Each of the {noun} holds {b} {it}."
        else:
            b = rng.randint(2, 40)
            new, text = (v * b, "kilograms", "kilograms"), f"Each of the {noun} weighs {b} kilograms."
    elif kind == "items":
        r = rng.random()
        if r < 0.4:
            b = rng.randint(2, 45)
            new, text = (v * b, "dollars", "dollars"), f"{n} sells each of the {noun} for {b} dollars."
        elif r < 0.7:
            b = rng.randint(15, 500)
            new, text = (v * b, "grams", "grams"), f"Each of the {noun} weighs {b} grams."
        else:
            b = rng.randint(2, 30)
            new, text = (v * b, "minutes", "minutes"), f"Checking each of the {noun} takes {b} minutes."
    elif kind == "hours":
        b = rng.randint(8, 60)
        new, text = (v * b, "dollars", "dollars"), f"{n} is paid {b} dollars for each hour."
    else:
        return None
    return (new, text, ["times", b]) if new[0] <= MAX_VALUE else None


def _convert(rng, v, kind, noun, n):
    """A change of unit: kilograms -> grams, or grams -> kilograms / minutes -> hours where it divides exactly."""
    if kind == "kilograms" and v * 1000 <= MAX_VALUE:
        return (v * 1000, "grams", "grams"), "The weight is now written in grams.", ["times", 1000]
    if kind == "grams" and v % 1000 == 0:
        return (v // 1000, "kilograms", "kilograms"), "The weight is now written in kilograms.", ["divide", 1000]
    if kind == "minutes" and v % 60 == 0:
        return (v // 60, "hours", "hours"), "The time is now counted in hours.", ["divide", 60]
    if kind == "dollars" and rng.random() < 0.5:
        fits = [d for d in range(2, 13) if v % d == 0]
        if not fits:
            return None
        b = rng.choice(fits)
        return (v // b, "dollars", "dollars"), (f"{n} shares the money equally among {b} partners and keeps one "
                                                "share."), ["divide", b]
    return None


STEPS = {"add": _add, "sub": _sub, "fraction": _fraction, "percent": _percent, "pack": _pack, "per_unit": _per_unit,
         "convert": _convert}

QUESTION = {"items": "How many {noun} does {n} have now?", "containers": "How many {noun} does {n} have now?",
            "dollars": "How many dollars does {n} have now?", "grams": "How many grams is that now?",
            "kilograms": "How many kilograms is that now?", "minutes": "How many minutes is that in total?",
            "hours": "How many hours is that in total?"}


def make_problem(rng: random.Random, steps: int | None = None) -> dict:
    """One problem of `steps` operations (drawn from MIN_STEPS..MAX_STEPS when None)."""
    steps = steps or rng.randint(MIN_STEPS, MAX_STEPS)
    n, place, noun = rng.choice(NAMES), rng.choice(PLACES), rng.choice(ITEMS)
    v = rng.randint(10, 9999) if rng.random() < 0.7 else rng.randint(10, 99) * rng.choice([10, 12, 20, 24, 60, 100])
    state = (v, "items", noun)
    sentences, chain = [f"{n} runs {place} that has {v} {noun}."], [["start", v]]
    while len(chain) <= steps:
        op = rng.choice(list(STEPS))
        step = STEPS[op](rng, *state, n)
        if step is None:
            continue  # this operation cannot apply to the current value: draw another
        state, text, record = step
        sentences.append(text)
        chain.append([*record, state[0]])
    sentences.append(QUESTION[state[1]].format(noun=state[2], n=n))
    return {"problem": " ".join(sentences), "answer": str(state[0]), "steps": steps, "chain": chain}


def make_problems(n: int, rng: random.Random, exclude=()) -> list[dict]:
    """n problems with distinct texts, none of them in exclude."""
    return distinct_problems(make_problem, n, rng, exclude)


def ensure_multistep_problems(out_dir: str | None = None) -> dict:
    """train.jsonl / eval.jsonl, written once into out_dir (default: the cache or $MULTISTEP_PROBLEMS_DIR);
    returns their paths."""
    out_dir = out_dir or cache_dir(VERSION, "MULTISTEP_PROBLEMS_DIR")
    return ensure_problem_splits(out_dir, make_problems, N_TRAIN, N_EVAL, SEED)


if __name__ == "__main__":
    p = ensure_multistep_problems(sys.argv[1] if len(sys.argv) > 1 else None)
    print(p["train"])
    print(p["eval"])

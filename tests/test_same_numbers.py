"""The scripts train the same and log the same as they did when tests/data/same_numbers.json was recorded (from main
before the step loop's restructuring, tests/same_numbers.py): for each case, a fixed-seed built-in-task run samples
the same tokens (exactly), logs the same metrics.jsonl keys with the same values and ends with the same weights.
Tolerances: a run is fp32 on one thread; a restructuring may change the order in which a statistic is summed
(relative rounding ~1e-7 per addition, a few hundred additions) and another CPU family another BLAS summation order
(the same size, compounded over 3 optimizer steps through Adam): rtol 1e-4 leaves a wide margin over both, while a
wiring change (a weight not applied, a normalizer off by a factor) moves these numbers by percents. Sums that are 0
up to rounding (a clip fraction of 0, a mean advantage) get an absolute 1e-6.
Record anew (only when a change is meant to change the numbers, and say so in its commit): python tests/same_numbers.py record"""
import json
import math

import pytest

from same_numbers import CASES, REFERENCE, run_case

RTOL, ATOL = 1e-4, 1e-6

with open(REFERENCE) as f:
    REF = json.load(f)


def close(a, b, atol=ATOL):
    return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + RTOL * abs(b))


@pytest.mark.parametrize("name,script,flags", CASES, ids=[c[0] for c in CASES])
def test_same_numbers_as_recorded(name, script, flags, tmp_path):
    got, ref = run_case(name, script, flags, str(tmp_path)), REF[name]
    assert got["sampled"] == ref["sampled"], "other tokens were sampled"
    assert [r["step"] for r in got["rows"]] == [r["step"] for r in ref["rows"]]
    for g, r in zip(got["rows"], ref["rows"]):
        assert sorted(g) == sorted(r), f"step {r['step']}: keys {sorted(set(g) ^ set(r))}"
        bad = {k: (g[k], r[k]) for k in r if not close(g[k], r[k])}
        assert not bad, f"step {r['step']}: {bad}"
    assert sorted(got["weights"]) == sorted(ref["weights"])
    for tensor, (n, s, sq, dot) in ref["weights"].items():
        gn, gs, gsq, gdot = got["weights"][tensor]
        # a sum of n weights, each within RTOL of its value, moves by at most RTOL * sum|w| <= RTOL sqrt(n sq)
        scale = math.sqrt(n * sq)
        assert gn == n and close(gsq, sq) and close(gs, s, ATOL + RTOL * scale) and \
            close(gdot, dot, ATOL + RTOL * scale), f"{tensor}: {[gn, gs, gsq, gdot]} vs {[n, s, sq, dot]}"

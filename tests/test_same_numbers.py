"""The scripts train the same and log the same as they did when tests/data/same_numbers.json was recorded
(tests/same_numbers.py), on any machine: for each case, a fixed-seed run of the built-in task with a fixed model (its
weights drawn as integers, the same bits everywhere) and recorded responses replayed through the fallback sampler's
decoding loop asks for the same prompts in the same order and gets the same responses (exactly), logs the same
metrics.jsonl keys with the same values and moves the weights by the same update.
Tolerances, from the arithmetic: a run is fp32; another CPU family, thread count or summation order changes only
rounding. One step's forward and backward differ by at most fp32_rounding_bound (tests/conftest.py: u times the
lengths of the sums along the longest path, here ~3e-4 relative to the magnitude of the terms); the weights' update
(AdamW: the gradient's moments, normalized) carries that relative error into the next step, and the errors of the
NUM_STEPS steps add: RTOL ~1e-3. A logged number is compared with RTOL times its magnitude, or 1 for a number that sums
terms of order one (rewards, advantages, probabilities, ratios, fractions) to less; an update of a tensor within RTOL
of its norm (|delta| <= RTOL |update|) moves its squared norm by at most ~2 RTOL |update|^2 and its sum and its dot
with the fixed vector (|r_i| <= 1/2) by at most RTOL sqrt(n) |update| (Cauchy-Schwarz). A wiring change (a weight not
applied, a normalizer off by a factor) moves these numbers by percents (docs/tests.md: the bugs planted to check it).
Record anew (only when a change is meant to change the numbers, and say so in its commit): python tests/same_numbers.py record"""
import json
import math

import pytest

from conftest import fp32_rounding_bound
from same_numbers import CASES, REFERENCE, SMALL, run_case

with open(REFERENCE) as f:
    REF = json.load(f)


def _rtol() -> float:
    """NUM_STEPS x the rounding bound of a forward and backward of the fixed model (the built-in task's architecture)
    on sequences of at most the preset's prompt and response lengths, a micro-batch holding every sequence."""
    from grpo import BUILTIN
    from tasks.builtin import build_model, build_tokenizer
    cfg = build_model(build_tokenizer()).config
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads  # what Qwen2 uses when its config names none
    arg = {k: int(v) for k, v in zip(SMALL[::2], SMALL[1::2])}
    seq_len = BUILTIN["max_prompt_len"] + BUILTIN["max_response_len"]
    tokens = arg["--num-prompts"] * arg["--group-size"] * seq_len
    return arg["--num-steps"] * fp32_rounding_bound(cfg, seq_len, tokens, backward=True)


RTOL = _rtol()


def close(got: float, want: float, tol: float) -> bool:
    return got == want or (math.isfinite(got) and math.isfinite(want) and abs(got - want) <= tol)


def test_record_named_cases_keeps_the_others(tmp_path, monkeypatch):
    """`record NAME`, as for a fork's new case, records that case and leaves the others' recordings as they were;
    `record` alone records every case anew; an unknown name is refused before anything runs."""
    import same_numbers
    ran = []
    monkeypatch.setattr(same_numbers, "run_case",
                        lambda name, script, flags, workdir: ran.append(name) or {"new": name})
    reference = str(tmp_path / "data" / "ref.json")
    same_numbers.record([CASES[1][0]], reference, str(tmp_path))  # no file yet: the one case
    with open(reference) as f:
        assert json.load(f) == {CASES[1][0]: {"new": CASES[1][0]}}
    with open(reference, "w") as f:
        json.dump({"old_case": {"kept": 1}, CASES[1][0]: {"stale": 1}}, f)
    same_numbers.record([CASES[1][0]], reference, str(tmp_path))
    with open(reference) as f:
        assert json.load(f) == {"old_case": {"kept": 1}, CASES[1][0]: {"new": CASES[1][0]}}
    ran.clear()
    same_numbers.record([], reference, str(tmp_path))
    with open(reference) as f:
        assert json.load(f) == {c[0]: {"new": c[0]} for c in CASES} and ran == [c[0] for c in CASES]
    ran.clear()
    with pytest.raises(SystemExit, match="no such case: my_algo"):
        same_numbers.record(["my_algo"], reference, str(tmp_path))
    assert ran == []


@pytest.mark.parametrize("name,script,flags", CASES, ids=[c[0] for c in CASES])
def test_same_numbers_as_recorded(name, script, flags, tmp_path):
    assert name in REF, f"{name}: not recorded; record it with: python tests/same_numbers.py record {name}"
    ref = REF[name]
    got = run_case(name, script, flags, str(tmp_path), recorded=ref["sampled"])
    assert got["sampled"] == ref["sampled"], "other prompts or responses"
    assert [r["step"] for r in got["rows"]] == [r["step"] for r in ref["rows"]]
    for g, r in zip(got["rows"], ref["rows"]):
        assert sorted(g) == sorted(r), f"step {r['step']}: keys {sorted(set(g) ^ set(r))}"
        bad = {k: (g[k], r[k]) for k in r if not close(g[k], r[k], RTOL * max(abs(r[k]), 1.0))}
        assert not bad, f"step {r['step']}: {bad} (tolerance {RTOL:.2g} x max(|value|, 1))"
    assert sorted(got["weights"]) == sorted(ref["weights"])
    for tensor, (n, sq, s, dot) in ref["weights"].items():
        gn, gsq, gs, gdot = got["weights"][tensor]
        norm = math.sqrt(sq)
        assert gn == n and close(gsq, sq, (2 * RTOL + RTOL ** 2) * sq) and close(gs, s, RTOL * math.sqrt(n) * norm) \
            and close(gdot, dot, RTOL * math.sqrt(n) * norm), f"{tensor}: {[gn, gsq, gs, gdot]} vs {[n, sq, s, dot]}"

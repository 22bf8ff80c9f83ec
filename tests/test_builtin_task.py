"""Tests for the built-in addition task (tasks/builtin.py): the task as the scripts build it on first use, in the cache
(~90 s on 2 CPU cores, once per machine; concurrent callers build it once: tests/test_task_cache.py)."""
import json
import os

import pytest

from tasks.builtin import ensure_builtin_task, make_datasets, sample_accuracy
from tasks.cache import MARKER


@pytest.fixture(scope="session")
def paths():
    return ensure_builtin_task()


@pytest.fixture(scope="session")
def loaded(paths):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(paths["model"]), AutoTokenizer.from_pretrained(paths["model"])


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_files_exist_and_load(paths, loaded):
    for key in ("train", "eval"):
        assert os.path.isfile(paths[key])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "task.json"):
        assert os.path.isfile(os.path.join(paths["model"], name))
    model, tok = loaded
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert tok.chat_template is None


def test_tokenizer(loaded):
    model, tok = loaded
    problem, answer = "347+58=", "405"
    ids = tok.encode(problem, add_special_tokens=True)
    assert len(ids) == len(problem)  # one id per char, no BOS
    assert tok.decode(ids) == problem  # joined without spaces
    assert tok.unk_token_id not in ids
    resp = tok.encode(answer) + [tok.eos_token_id]
    assert tok.decode(resp, skip_special_tokens=True) == answer
    assert tok.decode(resp).endswith(tok.eos_token)
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>" and tok.pad_token_id != tok.eos_token_id
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_config(loaded):
    model, _ = loaded
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim >= 32
    assert cfg.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_datasets(paths):
    train, evals = read_jsonl(paths["train"]), read_jsonl(paths["eval"])
    assert 2000 <= len(train) <= 4000 and 100 <= len(evals) <= 500
    for row in train + evals:
        assert set(row) == {"problem", "answer"}
        a, b = row["problem"].rstrip("=").split("+")
        assert row["problem"].endswith("=") and int(row["answer"]) == int(a) + int(b)
        assert row["answer"] == str(int(a) + int(b))  # canonical form, no leading zeros
    train_set = {r["problem"] for r in train}
    assert len(train_set) == len(train)
    assert not train_set & {r["problem"] for r in evals}
    assert (train, evals) == make_datasets()  # fixed seed: same problems every build


def test_accuracy_band(paths, loaded):
    with open(os.path.join(paths["model"], "task.json")) as f:
        info = json.load(f)
    for key in ("max_digits", "sft_steps", "sampled_acc_t1", "greedy_acc", "build_seconds"):
        assert key in info
    assert 0.2 <= info["sampled_acc_t1"] <= 0.8
    model, tok = loaded
    # Re-measure on fresh samples of a subset of the train problems: should be close to the recorded value.
    acc = sample_accuracy(model, tok, read_jsonl(paths["train"])[:128], temperature=1.0, n_samples=8, seed=123)
    assert abs(acc - info["sampled_acc_t1"]) < 0.15, (acc, info["sampled_acc_t1"])


def test_second_call_is_cached(paths, tmp_path, monkeypatch):
    task_dir = os.path.dirname(paths["model"])
    marker = os.path.join(task_dir, MARKER)
    mtime = os.path.getmtime(marker)
    assert ensure_builtin_task(task_dir) == paths
    assert os.path.getmtime(marker) == mtime  # not built again
    # the env var picks the cache dir when none is given: another directory, marked complete (so nothing is built)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / MARKER).write_text("ok\n")
    monkeypatch.setenv("BUILTIN_TASK_DIR", str(other))
    assert ensure_builtin_task() == {"model": str(other / "model"), "train": str(other / "train.jsonl"),
                                     "eval": str(other / "eval.jsonl")}

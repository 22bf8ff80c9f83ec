import json
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tasks.data import INSTRUCTION, encode_problems, format_prompt, load_problems

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(chat_template=None):
    """Character-level tokenizer built in memory (no downloads); prepends <s> like Llama does."""
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per char
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat_template:
        hf.chat_template = chat_template
    return hf


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------
# load_problems


def test_jsonl_with_aliases_and_blank_lines(tmp_path):
    lines = [
        json.dumps({"problem": "1+1?", "answer": "2"}),
        "",
        json.dumps({"prompt": "2+2?", "solution": 4}),  # numeric answer -> str
        "   ",
        json.dumps({"question": "half?", "answer": 0.5, "extra": "ignored"}),
    ]
    path = write(tmp_path / "train.jsonl", "\n".join(lines) + "\n")
    assert load_problems(path) == [
        {"problem": "1+1?", "answer": "2"},
        {"problem": "2+2?", "answer": "4"},
        {"problem": "half?", "answer": "0.5"},
    ]


def test_json_list(tmp_path):
    rows = [{"problem": "p1", "answer": "a1"}, {"question": "p2", "solution": "so \\boxed{\\frac{1}{2}}."}]
    path = write(tmp_path / "test.json", json.dumps(rows))
    problems = load_problems(path)
    # a full worked solution is kept as is; the reward extracts its last \boxed
    assert problems == [{"problem": "p1", "answer": "a1"}, {"problem": "p2", "answer": "so \\boxed{\\frac{1}{2}}."}]
    assert all(set(p) == {"problem", "answer"} for p in problems)


def test_parquet(tmp_path):
    path = str(tmp_path / "data.parquet")
    pq.write_table(pa.table({"prompt": ["what is 3*4?", "what is 5-1?"], "answer": [12, 4], "id": [0, 1]}), path)
    assert load_problems(path) == [
        {"problem": "what is 3*4?", "answer": "12"},
        {"problem": "what is 5-1?", "answer": "4"},
    ]


def test_problem_field_takes_precedence(tmp_path):
    path = write(tmp_path / "d.jsonl", json.dumps({"question": "q", "problem": "p", "solution": "s", "answer": "a"}))
    assert load_problems(path) == [{"problem": "p", "answer": "a"}]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_problems(str(tmp_path / "nope.jsonl"))


def test_unknown_extension(tmp_path):
    path = write(tmp_path / "data.csv", "problem,answer\n1+1,2\n")
    with pytest.raises(ValueError, match=r"data\.csv.*\.csv.*\.jsonl, \.json or \.parquet"):
        load_problems(path)


def test_broken_json_line(tmp_path):
    lines = [json.dumps({"problem": "p", "answer": "a"}), "", '{"problem": "p", "answer": ']
    path = write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: invalid JSON") as e:
        load_problems(path)
    assert "\n" not in str(e.value)


def test_broken_json_file(tmp_path):
    path = write(tmp_path / "bad.json", '[{"problem": "p", "answer": "a"},\n {"problem": }]')
    with pytest.raises(ValueError, match=r"bad\.json: line 2: invalid JSON"):
        load_problems(path)


def test_json_not_a_list(tmp_path):
    path = write(tmp_path / "d.json", json.dumps({"problem": "p", "answer": "a"}))
    with pytest.raises(ValueError, match="expected a JSON list"):
        load_problems(path)


def test_row_not_an_object(tmp_path):
    path = write(tmp_path / "d.jsonl", json.dumps({"problem": "p", "answer": "a"}) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: expected a JSON object, got list"):
        load_problems(path)


def test_missing_problem_field(tmp_path):
    path = write(tmp_path / "d.jsonl", json.dumps({"problem": "p", "answer": "a"}) + "\n" + json.dumps({"text": "p", "answer": "a"}))
    with pytest.raises(ValueError) as e:
        load_problems(path)
    msg = str(e.value)
    assert "d.jsonl: line 2" in msg and "problem" in msg
    assert "problem, prompt, question" in msg  # tells the user which names work
    assert "text" in msg  # and what the row has


def test_missing_answer_field_in_json(tmp_path):
    path = write(tmp_path / "d.json", json.dumps([{"problem": "p", "answer": "a"}, {"problem": "p", "final": "a"}]))
    with pytest.raises(ValueError, match=r"d\.json: row 1 \(0-based\): missing the answer \(accepted field names: answer, solution"):
        load_problems(path)


def test_missing_answer_in_parquet_row(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"problem": ["p1", "p2"], "answer": ["a", None]}), path)
    with pytest.raises(ValueError, match=r"row 1 .*answer, solution"):
        load_problems(path)


def test_wrong_field_type(tmp_path):
    path = write(tmp_path / "d.jsonl", json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "a"}))
    with pytest.raises(ValueError, match=r"line 1: field 'prompt' should be a string, got list"):
        load_problems(path)


@pytest.mark.parametrize("name,text", [("e.jsonl", "\n\n"), ("e.json", "[]")])
def test_empty_dataset(tmp_path, name, text):
    with pytest.raises(ValueError, match="empty"):
        load_problems(write(tmp_path / name, text))


def test_empty_parquet(tmp_path):
    path = str(tmp_path / "e.parquet")
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match="empty"):
        load_problems(path)


# ----------------------------------------------------------------------------
# format_prompt / encode_problems


def test_chat_template():
    tok = make_tokenizer(CHAT_TEMPLATE)
    ids = format_prompt(tok, "1+1?", "chat")
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert ids == tok.encode(f"<|user|>1+1? {INSTRUCTION}<|assistant|>", add_special_tokens=False)
    # special tokens of the template are single tokens
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_chat_template_missing():
    with pytest.raises(ValueError, match=r"no chat template.*--prompt-template"):
        format_prompt(make_tokenizer(), "1+1?", "chat")


def test_raw_template():
    tok = make_tokenizer()
    ids = format_prompt(tok, "1+1?", "Q: {problem}\n{instruction}\nA:")
    assert ids[0] == tok.bos_token_id  # this tokenizer adds BOS by default, so the prompt gets it
    assert ids[1:] == tok.encode(f"Q: 1+1?\n{INSTRUCTION}\nA:", add_special_tokens=False)
    # {instruction} is optional
    assert format_prompt(tok, "1+1?", "{problem}=")[1:] == tok.encode("1+1?=", add_special_tokens=False)


@pytest.mark.parametrize(
    "template,match",
    [
        ("{instruction} answer:", r"no \{problem\} field"),
        ("{problem} {answer}", "unknown fields"),
        ("{problem} \\boxed{}", "literal brace"),
    ],
)
def test_bad_raw_template(template, match):
    problems = [{"problem": "1+1", "answer": "2"}]
    with pytest.raises(ValueError, match=match):
        encode_problems(make_tokenizer(), problems, template, max_prompt_len=100)


def test_encode_problems_skips_long_prompts(capsys):
    tok = make_tokenizer()
    problems = [{"problem": "x" * n, "answer": str(n)} for n in (3, 40, 5, 60)]
    out = encode_problems(tok, problems, "{problem}", max_prompt_len=20, name="train.jsonl")
    assert [p["answer"] for p in out] == ["3", "5"]  # kept ones stay in order, uncut
    assert out[0]["prompt_ids"] == format_prompt(tok, "xxx", "{problem}")
    assert out[0]["problem"] == "xxx"
    printed = capsys.readouterr().out
    # lengths include BOS: "x"*60 -> 61 tokens
    assert printed.strip() == "[data] train.jsonl: skipped 2 of 4 prompts longer than 20 tokens (longest 61)"


def test_encode_problems_quiet_when_nothing_skipped(capsys):
    out = encode_problems(make_tokenizer(), [{"problem": "ab", "answer": "1"}], "{problem}", max_prompt_len=20)
    assert len(out) == 1 and capsys.readouterr().out == ""


def test_encode_problems_all_too_long():
    problems = [{"problem": "x" * 50, "answer": "1"}, {"problem": "x" * 30, "answer": "2"}]
    with pytest.raises(ValueError, match=r"all 2 prompts are longer than 10 tokens \(longest 51\).*--max-prompt-len"):
        encode_problems(make_tokenizer(), problems, "{problem}", max_prompt_len=10, name="test.jsonl")


def test_encode_problems_chat():
    tok = make_tokenizer(CHAT_TEMPLATE)
    out = encode_problems(tok, [{"problem": "2+2?", "answer": "4"}], "chat", max_prompt_len=500)
    assert out == [{"prompt_ids": format_prompt(tok, "2+2?", "chat"), "answer": "4", "problem": "2+2?"}]


def test_raw_template_backslash_n_from_the_command_line_is_a_newline():
    tok = make_tokenizer()
    ids = format_prompt(tok, "ab", "{problem}\\nx")
    assert ids == format_prompt(tok, "ab", "{problem}\nx") and tok.convert_tokens_to_ids("\n") in ids


def test_chat_template_with_a_user_format():
    """'chat:<format>': the chat template around a user turn of one's own (no R1 instruction)."""
    tok = make_tokenizer(CHAT_TEMPLATE)
    ids = format_prompt(tok, "1+1?", "chat:{problem} Answer with a number.")
    assert ids == tok.encode("<|user|>1+1? Answer with a number.<|assistant|>", add_special_tokens=False)
    ids2 = format_prompt(tok, "1+1?", "chat:{problem}\\n{instruction}")  # {instruction} and a typed \n work there too
    assert ids2 == tok.encode(f"<|user|>1+1?\n{INSTRUCTION}<|assistant|>", add_special_tokens=False)
    with pytest.raises(ValueError, match="no {problem} field"):
        encode_problems(tok, [{"problem": "2+2?", "answer": "4"}], "chat:Answer.", max_prompt_len=500)
    with pytest.raises(ValueError, match="unknown fields"):
        format_prompt(tok, "1+1?", "chat:{problem} {answer}")

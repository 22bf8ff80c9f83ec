"""Prompt datasets: load {problem, answer} rows from disk and turn them into token ids."""
import json
import os
import string
from functools import lru_cache

from transformers import AutoTokenizer

from common.dist import print0

# the instruction the DeepSeek-R1 distilled models were trained with
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

PROBLEM_FIELDS = ("problem", "prompt", "question")  # first one present wins
ANSWER_FIELDS = ("answer", "solution")


def read_rows(path: str) -> list[tuple[str, object]]:
    """(where, row) pairs of a .jsonl, .json or .parquet file; `where` says where a row came from, for error messages
    (the datasets' reader, and the reward model's pairs')."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        rows = []
        with open(path, "rb") as f:  # bytes, decoded line by line: an error names its line
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: line {lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                     f"{e.start + 1}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    rows.append((f"line {lineno}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        return rows
    if ext == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save "
                                 "the file as UTF-8") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    elif ext == ".parquet":
        import pyarrow.parquet as pq
        try:
            data = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a bad file
            raise ValueError(f"{path}: could not read parquet file ({type(e).__name__}: {e})".replace("\n", " ")
                             ) from None
    else:
        raise ValueError(f"{path}: unknown dataset file extension {ext!r} (expected .jsonl, .json or .parquet)")
    return [(f"row {i} (0-based)", row) for i, row in enumerate(data)]


def _pick_field(row: dict, names: tuple, what: str, where: str) -> str:
    for name in names:
        value = row.get(name)
        if value is None:  # absent (or null, e.g. a parquet column missing in this row)
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # numeric answers like 42 or 0.5
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {name!r} should be a string, got {type(value).__name__}")
        if not value.strip():
            raise ValueError(f"{where}: field {name!r} is empty")
        return value
    raise ValueError(f"{where}: missing the {what} (accepted field names: {', '.join(names)}; found: "
                     f"{', '.join(row) or 'none'})")


def load_problems(path: str) -> list[dict]:
    """A .jsonl / .json / .parquet file's rows as [{"problem": str, "answer": str}]; an answer (or a worked solution
    ending in \\boxed{...}) is kept as is: the reward function extracts the last box."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    problems = []
    for where, row in read_rows(path):
        where = f"{path}: {where}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        problems.append({"problem": _pick_field(row, PROBLEM_FIELDS, "problem", where),
                         "answer": _pick_field(row, ANSWER_FIELDS, "answer", where)})
    if not problems:
        raise ValueError(f"{path}: no problems found (the dataset is empty)")
    return problems


@lru_cache(maxsize=16)  # validate each template once, not once per problem
def _check_template(template: str) -> None:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ValueError(f"bad prompt template {template!r}: {e} (write a literal brace as {{{{ or }}}})") from None
    if "problem" not in fields:
        raise ValueError(f"prompt template {template!r} has no {{problem}} field, e.g. "
                         "\"{problem}\\n{instruction}\\n\"")
    if unknown := fields - {"problem", "instruction"}:
        raise ValueError(f"prompt template {template!r} has unknown fields {sorted(unknown)} (allowed: {{problem}}, "
                         "{instruction}; write a literal brace as {{ or }})")


def _format_of(template: str) -> str:
    """The format string of a --prompt-template: 'chat', 'chat:<format>' or a format string itself."""
    return "{problem} {instruction}" if template == "chat" else template.removeprefix("chat:")


def is_chat(template: str) -> bool:
    """Whether a --prompt-template puts the problem into a user turn of the tokenizer's chat template."""
    return template == "chat" or template.startswith("chat:")


def prompt_text(problem: str, template: str) -> str:
    """The text a --prompt-template makes of a problem: the user turn's content for 'chat' / 'chat:<format>', the
    whole prompt for a raw format string. (A reward model reads this, formatted with its own tokenizer.)"""
    _check_template(user := _format_of(template))
    # a shell passes "\n" typed in --prompt-template as backslash + n: it means a newline
    return user.replace("\\n", "\n").format(problem=problem, instruction=INSTRUCTION)


def format_prompt(tokenizer, problem: str, template: str) -> list[int]:
    """Token ids of one problem's prompt; template as --prompt-template: "chat" or "chat:<format>" (the tokenizer's
    chat template around prompt_text) or a format string with {problem}, optionally {instruction}."""
    if is_chat(template):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass a raw template instead, "
                             'e.g. --prompt-template "{problem}\\n{instruction}\\n"')
        messages = [{"role": "user", "content": prompt_text(problem, template)}]
        # return_dict=False: the token ids as a list (transformers 5's default is a BatchEncoding, 4.x's the list)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    # add_special_tokens=True gives BOS to tokenizers that want it (Llama) and nothing to those that don't (Qwen); a
    # few also append EOS, which would tell the model it is already done
    ids = tokenizer.encode(prompt_text(problem, template), add_special_tokens=True)
    eos = tokenizer.eos_token_id
    if ids and eos is not None and ids[-1] == eos and eos != tokenizer.bos_token_id:
        ids = ids[:-1]
    return list(ids)


def encode_problems(tokenizer, problems: list[dict], template: str, max_prompt_len: int,
                    name: str = "dataset") -> list[dict]:
    """Each problem's dict plus "prompt_ids", those within max_prompt_len tokens."""
    if not problems:
        raise ValueError(f"[data] {name}: no problems to encode")
    _check_template(_format_of(template))
    all_ids = [format_prompt(tokenizer, p["problem"], template) for p in problems]
    longest = max(map(len, all_ids))
    # a prompt too long is skipped, never cut: a cut one would ask a different (or no) question
    encoded = [{"prompt_ids": ids, **p} for p, ids in zip(problems, all_ids) if len(ids) <= max_prompt_len]
    n_skipped = len(problems) - len(encoded)
    if not encoded:
        raise ValueError(f"[data] {name}: all {len(problems)} prompts are longer than {max_prompt_len} tokens "
                         f"(longest {longest}); raise --max-prompt-len")
    if n_skipped:
        print(f"[data] {name}: skipped {n_skipped} of {len(problems)} prompts longer than {max_prompt_len} tokens "
              f"(longest {longest})")
    return encoded


def load_task(model: str, dataset: str, eval_paths, template: str, max_prompt_len: int, eval_max_problems: int):
    """(tokenizer, training problems, {eval set: at most eval_max_problems (0: all)}), encoded, and a line of counts."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    problems = encode_problems(tokenizer, load_problems(dataset), template, max_prompt_len, dataset)
    eval_sets = {}
    for path in eval_paths:  # eval/<file name without extension>/accuracy
        ps = encode_problems(tokenizer, load_problems(path), template, max_prompt_len, path)
        eval_sets[os.path.splitext(os.path.basename(path))[0]] = ps[:eval_max_problems] if eval_max_problems else ps
    print0(f"[data] {len(problems)} training problems; eval: "
           f"{', '.join(f'{k} ({len(v)})' for k, v in eval_sets.items()) or 'none'}")
    return tokenizer, problems, eval_sets

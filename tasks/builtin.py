"""
A built-in toy task so that RL runs end to end with no downloads: addition of
1-2 digit numbers ("47+38=" -> "85") by a tiny character-level Qwen2 model.

The warm start has two parts. Supervised training until the model mostly knows
the sums, then its output distribution is flattened (the final RMSNorm's weight,
hence every logit, is scaled by a factor < 1) until sampling at temperature 1.0
solves about 40% of the problems. That is the regime where GRPO has signal (some
samples of a problem right, some wrong) and can visibly improve within minutes
on a CPU: the knowledge is there, RL has to make the policy commit to it. A model
stopped early in supervised training instead makes systematic errors, which RL on
a 0.4M-parameter model fixes only slowly.

Usage: paths = ensure_builtin_task() -> {"model": dir, "train": jsonl, "eval": jsonl}
The build (~1 min on a 2-core CPU) happens once and is cached on disk.
"""
import json
import os
import random
import time

import torch

from tasks.cache import build_once, cache_dir, write_jsonl

VERSION = "builtin-v2"
MAX_DIGITS = 2            # operands have 1..MAX_DIGITS digits
N_TRAIN, N_EVAL = 2000, 200
SEED = 1234
TARGET_ACC = 0.85         # stop SFT once sampled (T=1) accuracy on a probe set passes this
MAX_SFT_STEPS = 3000      # hard cap so the build time stays bounded even if learning is slow
FLAT_ACC = 0.4            # then flatten the output distribution until sampled (T=1) accuracy is about this


def make_problems(n, rng, exclude=()):
    """n distinct {"problem": "a+b=", "answer": str(a+b)} dicts, none of whose problem is in exclude.
    The digit count of each operand is uniform in 1..MAX_DIGITS (so short sums are not rare)."""
    seen, out = set(exclude), []
    while len(out) < n:
        a, b = (rng.randrange(10 ** (d - 1) if d > 1 else 0, 10 ** d)
                for d in (rng.randint(1, MAX_DIGITS), rng.randint(1, MAX_DIGITS)))
        p = f"{a}+{b}="
        if p not in seen:
            seen.add(p)
            out.append({"problem": p, "answer": str(a + b)})
    return out


def build_tokenizer():
    """Character-level HF tokenizer: one id per character, no BOS, decode joins chars without spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list("0123456789+="))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # every char is a word
    tk.decoder = decoders.Fuse()  # default WordLevel decoding would join tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_model(tokenizer):
    """Tiny Qwen2: head_dim 64 (vLLM's CPU backend refuses small head dims), tied embeddings like Qwen2.5-0.5B."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    return model


def sft_batch(tokenizer, problems):
    """Right-padded (input_ids, labels) where only answer tokens + eos are supervised.
    Right padding needs no attention mask: with causal attention, real tokens never see the pads after them."""
    seqs = [(tokenizer.encode(p["problem"]), tokenizer.encode(p["answer"]) + [tokenizer.eos_token_id]) for p in problems]
    L = max(len(q) + len(a) for q, a in seqs)
    ids = torch.full((len(seqs), L), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), L), -100)
    for i, (q, a) in enumerate(seqs):
        ids[i, :len(q) + len(a)] = torch.tensor(q + a)
        labels[i, len(q):len(q) + len(a)] = torch.tensor(a)
    return ids, labels


@torch.no_grad()
def sample_success(model, tokenizer, problems, temperature=1.0, n_samples=1, max_new_tokens=6, seed=0):
    """Per-problem success rate over n_samples completions (temperature 0 = greedy).
    A completion is correct iff it is exactly the answer digits followed by eos. Prompts are grouped
    by length so no padding is needed; with sequences this short, recomputing without a KV cache is fine."""
    g = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    rate = [0.0] * len(problems)
    by_len = {}
    for i, p in enumerate(problems):
        by_len.setdefault(len(p["problem"]), []).append(i)
    for idxs in by_len.values():
        ids = torch.tensor([tokenizer.encode(problems[i]["problem"]) for i in idxs]).repeat_interleave(n_samples, 0)
        done = torch.zeros(len(ids), dtype=torch.bool)
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g).squeeze(1)
            nxt = torch.where(done, tokenizer.pad_token_id, nxt)
            ids = torch.cat([ids, nxt[:, None]], 1)
            done |= nxt == eos
            if done.all():
                break
        plen = len(problems[idxs[0]]["problem"])
        for k, row in enumerate(ids[:, plen:].tolist()):
            ok = eos in row and tokenizer.decode(row[:row.index(eos)]) == problems[idxs[k // n_samples]]["answer"]
            rate[idxs[k // n_samples]] += ok / n_samples
    model.train(was_training)
    return rate


def sample_accuracy(model, tokenizer, problems, temperature=1.0, n_samples=1, seed=0):
    """Mean per-problem success rate (see sample_success)."""
    r = sample_success(model, tokenizer, problems, temperature, n_samples, seed=seed)
    return sum(r) / len(r)


def warm_start(model, tokenizer, exclude, batch_size=64, lr=1e-3, eval_every=100):
    """Supervised training on fresh problems (disjoint from the RL sets) until sampled accuracy on a
    probe set passes TARGET_ACC. Returns (steps, probe)."""
    rng = random.Random(SEED + 1)
    probe = make_problems(200, rng, exclude)
    exclude = set(exclude) | {p["problem"] for p in probe}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    step, acc = 0, 0.0
    while step < MAX_SFT_STEPS:
        ids, labels = sft_batch(tokenizer, make_problems(batch_size, rng, exclude))
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % eval_every == 0:
            acc = sample_accuracy(model, tokenizer, probe, 1.0, n_samples=2, seed=step)
            print(f"[builtin] sft step {step}: loss {loss.item():.3f}, sampled acc {acc:.2f}", flush=True)
            if acc >= TARGET_ACC:
                break
    return step, probe


@torch.no_grad()
def flatten(model, tokenizer, probe, target=FLAT_ACC, iters=8):
    """Scale the final norm's weight (so every logit) by the factor that brings sampled (T=1) accuracy on the probe
    to about `target`, found by bisection: accuracy grows with the factor. Returns the factor."""
    w = model.model.norm.weight.clone()
    lo, hi = 0.0, 1.0
    for i in range(iters):
        mid = (lo + hi) / 2
        model.model.norm.weight.copy_(w * mid)
        acc = sample_accuracy(model, tokenizer, probe, 1.0, n_samples=4, seed=100 + i)
        lo, hi = (mid, hi) if acc < target else (lo, mid)
    factor = (lo + hi) / 2
    model.model.norm.weight.copy_(w * factor)
    return factor


def make_datasets():
    """The RL train and eval problems: fixed seed (same files every build), eval disjoint from train."""
    rng = random.Random(SEED)
    train = make_problems(N_TRAIN, rng)
    return train, make_problems(N_EVAL, rng, exclude={p["problem"] for p in train})


def _build(out_dir):
    t0 = time.time()
    train, evals = make_datasets()
    write_jsonl(os.path.join(out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(out_dir, "eval.jsonl"), evals)
    print(f"[builtin] wrote {len(train)} train / {len(evals)} eval addition problems ({MAX_DIGITS}-digit operands)",
          flush=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(SEED)  # deterministic init (the caller's RNG state is restored by fork_rng below)
    model = build_model(tokenizer)
    print(f"[builtin] tiny Qwen2: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; warm-starting", flush=True)
    steps, sft_probe = warm_start(model, tokenizer, exclude={p["problem"] for p in train + evals})
    factor = flatten(model, tokenizer, sft_probe)
    print(f"[builtin] flattened: logits scaled by {factor:.3f}", flush=True)
    # Final measurement on the RL train problems themselves, with the RL sampler's temperature.
    probe = train[:256]
    sampled = sample_accuracy(model, tokenizer, probe, 1.0, n_samples=8, seed=1)
    greedy = sample_accuracy(model, tokenizer, probe, 0.0)
    model_dir = os.path.join(out_dir, "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    info = dict(version=VERSION, max_digits=MAX_DIGITS, n_train=N_TRAIN, n_eval=N_EVAL, sft_steps=steps,
                logit_scale=round(factor, 4),
                sampled_acc_t1=round(sampled, 4), greedy_acc=round(greedy, 4), acc_probe_size=len(probe),
                build_seconds=round(time.time() - t0, 1))
    with open(os.path.join(model_dir, "task.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"[builtin] done in {info['build_seconds']}s after {steps} SFT steps: "
          f"sampled acc (T=1) {sampled:.3f}, greedy acc {greedy:.3f}", flush=True)


def ensure_builtin_task(cache: str | None = None) -> dict:
    """Build the task once into `cache` (default: the cache or $BUILTIN_TASK_DIR; tasks/cache.py) and return its
    paths."""
    def build(tmp: str) -> None:
        print(f"[builtin] building the task into {out_dir}", flush=True)
        with torch.random.fork_rng():  # don't disturb the caller's seeding
            _build(tmp)
    out_dir = os.path.abspath(os.path.expanduser(cache or cache_dir(VERSION, "BUILTIN_TASK_DIR")))
    build_once(out_dir, build)
    return {"model": os.path.join(out_dir, "model"), "train": os.path.join(out_dir, "train.jsonl"),
            "eval": os.path.join(out_dir, "eval.jsonl")}


def with_builtin_task(model: str | None, dataset: str | None, eval_paths: list[str]) -> tuple[str, str, list[str]]:
    """(model, training file, evaluation files) with the built-in task's (built on first use; a file lock keeps ranks
    from building it twice) in place of what is not given: its model without a model, its training file without a
    dataset, and then its evaluation file unless evaluation files are given."""
    if model is None or dataset is None:
        task = ensure_builtin_task()
        model = model or task["model"]
        if dataset is None:
            dataset, eval_paths = task["train"], eval_paths or [task["eval"]]
    return model, dataset, eval_paths

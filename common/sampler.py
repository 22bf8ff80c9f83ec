"""The sampler interface (docs/samplers.md): token ids in; per response, token ids, the sampler's own fp32 log-prob of
each sampled token (mu_logp) and whether it ended with end-of-sequence (common.batches.Rollout). Every sampler has
generate(prompts, n, max_new_tokens, temperature, top_p) -> Rollout, load_weights(named_tensors), sleep() / wake_up()
and shutdown(): common/vllm_sampler.py (vLLM in this process) and common/hf_sampler.py (the fallback)."""
import importlib.util

import torch

from common.dist import stream_seed
from common.hf_sampler import HFSampler
from common.vllm_sampler import VLLMSampler


def resolve_sampler(kind: str) -> tuple[str, str]:
    """'auto' -> 'vllm' when vLLM is installed and a GPU is present, else 'hf'. Returns (kind, why). Checked before
    any model is loaded: asking for vLLM where it is not installed is an error."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if kind == "auto":
        if has_vllm and torch.cuda.is_available():
            return "vllm", "auto: vLLM is installed and a GPU is present"
        return "hf", "auto: " + ("no GPU" if has_vllm else "vLLM is not installed") + ", the fallback sampler"
    if kind == "vllm" and not has_vllm:
        raise ValueError("--sampler vllm: vLLM is not installed (GPU: pip install vllm; CPU: make install), "
                         "or use --sampler hf")
    return kind, "as asked"


def make_sampler(flags, model_path: str, dtype: torch.dtype, device, seed: int, rank: int, max_model_len: int,
                 exact=None):
    """The sampler of a rank, as `flags` say: common.cli.Infra, or any object with its fields sampler,
    sampler_batch_size, vllm_gpu_memory_utilization and vllm_kv_cache_gib (a tool without vllm_tp or vllm_sleep_level
    gets 1 and 0). vLLM engines are seeded per TP group, the fallback sampler per rank, each with
    stream_seed(seed, index) (streams of runs with other seeds never coincide). exact: with --exact, the plan that the
    script got from exact.py (check_run, which refused any sampler but vLLM): the engine runs in exact mode
    (docs/exact.md). Prints which sampler and why."""
    kind, why = resolve_sampler(flags.sampler)
    tp, sleep_level = getattr(flags, "vllm_tp", 1), getattr(flags, "vllm_sleep_level", 0)
    if rank == 0:
        print(f"[sampler] {kind} ({why})", flush=True)
    if kind == "vllm":
        return VLLMSampler(model_path, dtype, stream_seed(seed, rank // tp), max_model_len, tp,
                           flags.vllm_gpu_memory_utilization, sleep_level, flags.vllm_kv_cache_gib, exact=exact)
    return HFSampler(model_path, dtype, device, stream_seed(seed, rank), flags.sampler_batch_size)

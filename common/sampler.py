"""The sampler interface (docs/samplers.md): the vLLM sampler (vllm_sampler.py), or the fallback (hf_sampler.py)."""
import importlib.util

import torch

from common.dist import stream_seed
from common.hf_sampler import HFSampler
from common.vllm_sampler import VLLMSampler


def resolve_sampler(kind: str) -> tuple[str, str]:
    """(kind, why): 'auto' is 'vllm' with vLLM installed and a GPU, else 'hf'; 'vllm' without vLLM is an error."""
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
    """The rank's sampler as `flags` (common.cli.Infra's sampler fields) say, seeded by stream_seed per TP group (vLLM)
    or rank (hf); exact: exact.py's plan, for the engine's exact mode (docs/exact.md). Prints which sampler and why."""
    kind, why = resolve_sampler(flags.sampler)
    tp, sleep_level = getattr(flags, "vllm_tp", 1), getattr(flags, "vllm_sleep_level", 0)
    if rank == 0:
        print(f"[sampler] {kind} ({why})", flush=True)
    if kind == "vllm":
        return VLLMSampler(model_path, dtype, stream_seed(seed, rank // tp), max_model_len, tp,
                           flags.vllm_gpu_memory_utilization, sleep_level, flags.vllm_kv_cache_gib, exact=exact)
    return HFSampler(model_path, dtype, device, stream_seed(seed, rank), flags.sampler_batch_size)

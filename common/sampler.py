"""The sampler interface (docs/samplers.md): token ids in; per response, token ids, the sampler's own fp32 log-prob of
each sampled token (mu_logp) and whether it ended with end-of-sequence. Every sampler has generate(prompts, n,
max_new_tokens, temperature, top_p) -> Rollout, load_weights(named_tensors), sleep() / wake_up() and shutdown().
The implementations (common/hf_sampler.py, common/vllm_sampler.py) import Rollout from here, never the other way round.
"""
import importlib.util
from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    prompt_ids: list[list[int]] = field(default_factory=list)  # one per response (each prompt repeated n times)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # fp32, one per response token (mu_logp)
    finished: list[bool] = field(default_factory=list)  # ended with end-of-sequence (not cut at the length limit)


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


def make_sampler(kind: str, model_path: str, precision: str, device, seed: int, rank: int, max_model_len: int,
                 batch_size: int, vllm_tp: int, vllm_gpu_memory_utilization: float, vllm_sleep_level: int,
                 vllm_kv_cache_gib: float = 0.0, exact=None):
    """The sampler of a rank: vLLM engines are seeded per TP group, the fallback sampler per rank, each with
    stream_seed(seed, index) (streams of runs with other seeds never coincide). exact: a common.exact.ExactPlan
    (vLLM only: exact mode, docs/exact.md)."""
    from common.dist import stream_seed
    from common.precision import DTYPES
    if kind == "vllm":
        from common.vllm_sampler import VLLMSampler
        return VLLMSampler(model_path, precision, stream_seed(seed, rank // vllm_tp), max_model_len, vllm_tp,
                           vllm_gpu_memory_utilization, vllm_sleep_level, vllm_kv_cache_gib, exact=exact)
    from common.hf_sampler import HFSampler
    return HFSampler(model_path, DTYPES[precision], device, stream_seed(seed, rank), batch_size)

"""The vLLM sampler (docs/samplers.md): an in-process engine per rank beside the trainer, seeded per TP group (never
per request), weights reloaded in place, asleep while training. vLLM internals: `_model_runner` and `_released_bytes`
here, and exact.py's."""
import gc
import importlib.util
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from common import metrics
from common.batches import Rollout
from common.precision import precision_name

logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
    lambda r: r.getMessage() != "RotaryEmbedding: Failed to load weights")  # each sync: its cos/sin cache is no weight


def _model_runner(llm):
    """The engine's model runner, inside vLLM (in-process engine, V1, as of vLLM 0.25-0.32)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _released_bytes() -> int:
    """Bytes of vLLM's sleep-mode pool released by sleep: PyTorch still counts its tensors as allocated, which would
    put the sleeping engine's share of the GPU into every mem/*_peak_gib (its allocator's records, vLLM 0.25-0.32)."""
    from vllm.device_allocator.cumem import CuMemAllocator
    return sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.is_asleep)


def _import_llm():
    """vllm.LLM, imported on a thread of its own: vLLM keeps an import error it caught (`torchcodec` missing), whose
    traceback pins the importing frames; from main(), main()'s model and process group lived on to the teardown."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: importlib.import_module("vllm").LLM).result()


def _sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """Each sampled token's log-prob from a response's FlatLogprobs (flat lists) or list of {token id: Logprob}."""
    if hasattr(logprobs, "start_indices"):
        if logprobs.token_ids == ids:  # with logprobs=0 just the sampled token's entry per position: the answer
            return logprobs.logprobs
        return [logprobs.logprobs[logprobs.token_ids.index(t, a, b)]
                for t, a, b in zip(ids, logprobs.start_indices, logprobs.end_indices)]
    return [lp[t].logprob for lp, t in zip(logprobs, ids)]


def rollout_of(prompts: list[list[int]], outputs) -> Rollout:
    """A Rollout of llm.generate's outputs for `prompts` (finished: ended with a stop token, not at the limit)."""
    out = Rollout()
    for prompt, request in zip(prompts, outputs):
        for c in request.outputs:
            ids = list(c.token_ids)
            out.prompt_ids.append(prompt)
            out.response_ids.append(ids)
            out.logprobs.append(torch.tensor(_sampled_logprobs(c.logprobs, ids), dtype=torch.float32))
            out.finished.append(c.finish_reason == "stop")
    return out


class VLLMSampler:
    def __init__(self, model_path: str, dtype: torch.dtype, seed: int, max_model_len: int, tp: int = 1,
                 gpu_memory_utilization: float = 0.3, sleep_level: int = 1, kv_cache_gib: float = 0.0,
                 exact=None, enforce_eager: bool | None = None, prefix_caching: bool = True):
        """exact: exact.py's ExactPlan, whose hooks make vLLM batch-invariant for the whole process (docs/exact.md) and
        give self.exact_facts (ExactPlan.attach). enforce_eager None: eager on a CPU only (exact mode decides)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        if exact is not None:
            exact.prepare_process()
        if importlib.util.find_spec("flashinfer") is None:  # some vLLM builds leave it out; vLLM's FlashInfer
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # sampler then fails at start, importing it
        # external_launcher reads torchrun's variables; those set here are unset at shutdown, for a later group of one
        values = {"RANK": dist.get_rank(), "LOCAL_RANK": dist.get_rank(), "WORLD_SIZE": dist.get_world_size()}
        self.env_set = [key for key in values if key not in os.environ]
        os.environ.update({key: str(values[key]) for key in self.env_set})
        LLM = _import_llm()
        # (exact: engine_args puts the RMSNorm patch in, before the engine builds the model)
        mode = exact.engine_args() if exact is not None else {
            "enforce_eager": not torch.cuda.is_available() if enforce_eager is None else enforce_eager}
        self.tp, self.sleep_level = tp, sleep_level if torch.cuda.is_available() else 0
        # weights_awake: their GPU memory is allocated; weights_loaded: the engine has them (a level 2 sleep drops them)
        self.asleep, self.weights_awake, self.weights_loaded = False, True, True
        # a fixed KV cache skips vLLM's free-memory measurement, which fails while another process on the GPU allocates
        # or frees, as parallel sanity runs do ("No available memory for the cache blocks", "Error in memory profiling")
        fixed_kv = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if kv_cache_gib > 0 else {}
        try:
            self.llm = LLM(model=model_path, dtype=dtype, seed=seed, skip_tokenizer_init=True, tensor_parallel_size=tp,
                           distributed_executor_backend="external_launcher", max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_level > 0,
                           logprobs_mode="processed_logprobs", enable_prefix_caching=prefix_caching, **mode, **fixed_kv)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            if any(w in str(e).lower() for w in ("dtype", "float16", "float32", "bfloat16", "not supported")):
                raise ValueError(f"vLLM refused {precision_name(dtype)} rollouts for this model: {e}. Choose another "
                                 f"--rollout-precision (or --sampler hf)") from e
            raise
        self.exact_plan, self.tp_group = exact, None
        self.exact_facts = exact.engine_started(self.llm, _model_runner(self.llm)) if exact is not None else None
        if tp > 1:  # every rank creates every TP group (new_group is collective), keeps its own
            if dist.get_world_size() % tp:
                raise ValueError(f"--vllm-tp {tp} does not divide the number of ranks {dist.get_world_size()}")
            groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, dist.get_world_size(), tp)]
            self.tp_group = groups[dist.get_rank() // tp]

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        if self.asleep and not self.weights_awake:
            self.llm.wake_up(tags=["weights"])  # the weights' memory back; their values come next
            self.weights_awake = True
            metrics.set_released(_released_bytes())
        _model_runner(self.llm).reload_weights(weights_iterator=named_tensors)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.weights_loaded = True

    def sleep(self) -> None:
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            metrics.set_released(_released_bytes())
            self.asleep, self.weights_awake = True, False
            self.weights_loaded = self.sleep_level == 1  # level 1 keeps a CPU copy; level 2 drops them

    def wake_up(self) -> None:
        if not self.asleep:
            return
        if not self.weights_loaded:
            raise RuntimeError("vLLM slept at level 2 (weights discarded) and no weights were loaded from the "
                               "trainer since: refusing to sample from uninitialised weights")
        self.llm.wake_up(tags=["kv_cache"] if self.weights_awake else None)
        metrics.set_released(0)
        self.asleep = False

    def shutdown(self) -> None:
        """Shut the engine down while its process group exists (vLLM's own clean-up at exit, after the group, fails)."""
        del self.llm
        self.tp_group = None  # (a group referenced after destroy_process_group keeps its threads)
        gc.collect()
        for key in self.env_set:
            os.environ.pop(key, None)

    ignore_eos = False  # True: every response runs to max_new_tokens (bench/forced_length.py: the worst case)

    @staticmethod
    def sampling_params(n: int, max_new_tokens: int, temperature: float, top_p: float = 1.0, ignore_eos: bool = False):
        """n samples per prompt, greedy at temperature <= 0, the sampled tokens' log-probs, no detokenization."""
        from vllm import SamplingParams
        greedy = temperature <= 0
        # flat_logprobs: flat lists, not a Logprob per token (one H100, 64 x 8 x 1,024 tokens: generate 13-21% faster)
        return SamplingParams(n=n, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                              max_tokens=max_new_tokens, logprobs=0, detokenize=False, flat_logprobs=True,
                              ignore_eos=ignore_eos)

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0) -> Rollout:
        from vllm.inputs import TokensPrompt
        mine = len(prompts)
        if self.tp_group is not None:  # the TP group's engines sample all the group's prompts together
            gathered = [None] * self.tp
            dist.all_gather_object(gathered, prompts, group=self.tp_group)
            offset = sum(len(g) for g in gathered[:dist.get_rank(self.tp_group)])
            prompts = [p for g in gathered for p in g]
        params = self.sampling_params(n, max_new_tokens, temperature, top_p, self.ignore_eos)
        # the same (possibly empty) list on every rank of a TP group, so all of them call the engine or none does
        outputs = (self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                   if prompts else [])
        if self.tp_group is not None:  # this rank's own share back
            prompts, outputs = prompts[offset:offset + mine], outputs[offset:offset + mine]
        return rollout_of(prompts, outputs)

"""The vLLM sampler: one in-process engine per torchrun rank, colocated with the trainer (docs/samplers.md):
external_launcher over the trainer's process group, seeded per rank (per TP group), never per request,
processed_logprobs (mu after temperature), weights reloaded in place from the trainer, sleep mode while it trains.
vLLM's internals are touched in `_model_runner` and, for exact mode (`exact=ExactPlan`), in exact.py's
"vLLM internals" section.
"""
import gc
import importlib
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from common.batches import Rollout
from common.precision import precision_name

def _model_runner(llm):
    """The one place that reaches into vLLM's internals (in-process engine, V1, as of vLLM 0.25-0.32)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _import_llm():
    """vllm.LLM, imported on a thread of its own. vLLM keeps an import error it caught (`torchcodec` missing), whose
    traceback holds the importing frames and their callers: imported from main(), it kept main()'s frame, and with it
    the model and the process group, alive to the interpreter's teardown (common/dist.py cleanup_distributed)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: importlib.import_module("vllm").LLM).result()


def _sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token from what vLLM returned for a response: FlatLogprobs (flat lists; with
    logprobs=0 one entry per position, the sampled token's), or a list of {token id: Logprob} per position."""
    if hasattr(logprobs, "start_indices"):
        if logprobs.token_ids == ids:  # one entry per position: the lists are the answer
            return logprobs.logprobs
        return [logprobs.logprobs[logprobs.token_ids.index(t, a, b)]
                for t, a, b in zip(ids, logprobs.start_indices, logprobs.end_indices)]
    return [lp[t].logprob for lp, t in zip(logprobs, ids)]



def rollout_of(prompts: list[list[int]], outputs) -> Rollout:
    """A Rollout of what llm.generate returned for `prompts`: each prompt's responses in order, their sampled tokens'
    log-probs (fp32), finished where the response ended with a stop token rather than at the length limit."""
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
        """exact: exact mode's plan (exact.py's ExactPlan, given by the script; this module calls its hooks
        prepare_process, engine_args and engine_started and imports no exact.py): vLLM in batch-invariant mode, for the
        whole process (docs/exact.md); self.exact_facts then holds what the trainer's exact forward needs from the
        engine (ExactPlan.attach).
        enforce_eager: None runs eager on a CPU only (exact mode decides for itself). prefix_caching: reuse the KV
        of shared prefixes."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        if exact is not None:
            exact.prepare_process()
        if importlib.util.find_spec("flashinfer") is None:  # some vLLM builds leave it out; vLLM's FlashInfer
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # sampler then fails at start, importing it
        # external_launcher reads torchrun's variables; a plain `python script.py` is a group of one
        self.env_set = []  # the variables set here, unset at shutdown: a later group of one must not look like torchrun
        for key, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", dist.get_rank()),
                           ("WORLD_SIZE", dist.get_world_size())):
            if key not in os.environ:
                os.environ[key] = str(value)
                self.env_set.append(key)
        LLM = _import_llm()
        if exact is not None:
            mode = exact.engine_args()  # (the RMSNorm patch goes in here: before the engine builds the model)
        else:
            mode = {"enforce_eager": not torch.cuda.is_available() if enforce_eager is None else enforce_eager}
        self.tp = tp
        self.sleep_level = sleep_level if torch.cuda.is_available() else 0
        self.asleep = False
        self.weights_awake = True  # the weights' GPU memory is allocated
        self.weights_loaded = True  # the engine holds the current weights (a level 2 sleep discards them)
        # a fixed KV cache skips vLLM's measurement of free memory at start, which fails when another process on
        # the same GPU allocates or frees meanwhile ("No available memory for the cache blocks", "Error in memory
        # profiling"), as parallel sanity runs do
        fixed_kv = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if kv_cache_gib > 0 else {}
        try:
            self.llm = LLM(model=model_path, dtype=dtype, seed=seed, tensor_parallel_size=tp,
                           distributed_executor_backend="external_launcher", max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True,
                           logprobs_mode="processed_logprobs", enable_sleep_mode=self.sleep_level > 0,
                           enable_prefix_caching=prefix_caching, **mode, **fixed_kv)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            text = str(e).lower()
            if any(w in text for w in ("dtype", "float16", "float32", "bfloat16", "not supported")):
                raise ValueError(f"vLLM refused {precision_name(dtype)} rollouts for this model: {e}. Choose another "
                                 f"--rollout-precision (or --sampler hf)") from e
            raise
        self.exact_plan, self.exact_facts = exact, None
        if exact is not None:
            self.exact_facts = exact.engine_started(self.llm, _model_runner(self.llm))
        self.tp_group = None
        if tp > 1:  # every rank creates every TP group (new_group is collective), keeps its own
            world = dist.get_world_size()
            if world % tp:
                raise ValueError(f"--vllm-tp {tp} does not divide the number of ranks {world}")
            for start in range(0, world, tp):
                group = dist.new_group(list(range(start, start + tp)))
                if start <= dist.get_rank() < start + tp:
                    self.tp_group = group

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        if self.asleep and not self.weights_awake:
            self.llm.wake_up(tags=["weights"])  # the weights' memory back; their values come next
            self.weights_awake = True
        _model_runner(self.llm).reload_weights(weights_iterator=named_tensors)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.weights_loaded = True

    def sleep(self) -> None:
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep, self.weights_awake = True, False
            self.weights_loaded = self.sleep_level == 1  # level 1 keeps a CPU copy; level 2 drops them

    def wake_up(self) -> None:
        if not self.asleep:
            return
        if not self.weights_loaded:
            raise RuntimeError("vLLM slept at level 2 (weights discarded) and no weights were loaded from the "
                               "trainer since: refusing to sample from uninitialised weights")
        self.llm.wake_up(tags=["kv_cache"] if self.weights_awake else None)
        self.asleep = False

    def shutdown(self) -> None:
        """Shut the engine down while the process group it joined still exists (at interpreter exit, after the
        trainer destroyed the group, vLLM's own clean-up fails)."""
        del self.llm
        self.tp_group = None  # (a group referenced after destroy_process_group keeps its threads)
        gc.collect()
        for key in self.env_set:
            os.environ.pop(key, None)

    ignore_eos = False  # True: every response runs to max_new_tokens (bench/forced_length.py: the worst case)

    @staticmethod
    def sampling_params(n: int, max_new_tokens: int, temperature: float, top_p: float = 1.0, ignore_eos: bool = False):
        """What generate asks of the engine: n samples per prompt, greedy at temperature <= 0, the sampled tokens'
        log-probs and no detokenization."""
        from vllm import SamplingParams
        greedy = temperature <= 0
        # flat_logprobs: the log-probs come back as flat lists per response rather than a dict and a Logprob object per
        # token, which the engine builds inside its decode loop (in this process: external_launcher keeps the engine
        # in-process). On one H100, 64 x 8 responses up to 1,024 tokens: llm.generate 13-21% faster
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

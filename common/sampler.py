"""Samplers: token ids in; per response, token ids, the sampler's own fp32 log-prob of each sampled token (mu_logp)
and whether it ended with end-of-sequence.

Every sampler has the same four methods, so the trainer does not know which one it holds:
  generate(prompts, n, max_new_tokens, temperature, top_p) -> Rollout
  load_weights(named_tensors)   in-place update from the trainer (an iterator of (HF name, full tensor))
  sleep() / wake_up()           free / take back the sampler's memory while the trainer trains (no-ops here)
  shutdown()                    release the sampler before the process group goes

HFSampler is the fallback: a plain (unsharded) copy of the policy in the rollout precision, decoded with a
transformers KV cache. The log-prob it reports is the one of the distribution it sampled from (after temperature
and top-p), as vLLM's `processed_logprobs`.
"""
import importlib.util
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, DynamicCache


@dataclass
class Rollout:
    prompt_ids: list[list[int]] = field(default_factory=list)  # one per response (each prompt repeated n times)
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # fp32, one per response token (mu_logp)
    finished: list[bool] = field(default_factory=list)  # ended with end-of-sequence (not cut at the length limit)


class HFSampler:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, seed: int, batch_size: int = 256):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.device, self.batch_size = device, batch_size
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos], device=device)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else int(self.eos_ids[0])
        self.generator = torch.Generator(device=device).manual_seed(seed)  # this rank's own sampling stream
        # every name the trainer will send, tied weights under both names
        self.params = dict(self.model.named_parameters(remove_duplicate=False))

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        missing = set(self.params)
        for name, t in named_tensors:
            if name not in self.params:
                continue  # a buffer (e.g. rotary inv_freq): derived from the config, not trained
            self.params[name].copy_(t)
            missing.discard(name)
        if missing:
            raise RuntimeError(f"weight sync: {len(missing)} sampler parameters not sent, e.g. {sorted(missing)[:3]}")

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0) -> Rollout:
        flat = [p for p in prompts for _ in range(n)]
        out = Rollout()
        for i in range(0, len(flat), self.batch_size):
            chunk = flat[i:i + self.batch_size]
            ids, lps, fin = self._generate_batch(chunk, max_new_tokens, temperature, top_p)
            out.prompt_ids += chunk
            out.response_ids += ids
            out.logprobs += lps
            out.finished += fin
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p):
        B, P = len(prompts), max(map(len, prompts))
        input_ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token goes at the same column
            input_ids[b, P - len(p):] = torch.tensor(p)
            attn[b, P - len(p):] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # positions count from each row's first real token
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens_BT = torch.zeros((B, max_new_tokens), dtype=torch.long, device=self.device)
        logp_BT = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=self.device)
        done_B = torch.zeros(B, dtype=torch.bool, device=self.device)
        length_B = torch.full((B,), max_new_tokens, dtype=torch.long, device=self.device)
        pos = pos[:, -1:]
        for t in range(max_new_tokens):
            logp_BV = process_logits(logits.float(), temperature, top_p)
            if temperature > 0:
                tok_B = torch.multinomial(logp_BV.exp(), 1, generator=self.generator).squeeze(-1)
            else:
                tok_B = logp_BV.argmax(-1)
            tokens_BT[:, t] = tok_B
            logp_BT[:, t] = logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)
            is_eos = torch.isin(tok_B, self.eos_ids) & ~done_B
            length_B = torch.where(is_eos, t + 1, length_B)
            done_B |= is_eos
            if bool(done_B.all()) or t == max_new_tokens - 1:
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], dim=1)
            pos = pos + 1
            logits = self.model(input_ids=tok_B[:, None], attention_mask=attn, position_ids=pos,
                                past_key_values=cache, use_cache=True).logits[:, -1]
        tokens, logps, lengths, done = tokens_BT.cpu(), logp_BT.cpu(), length_B.tolist(), done_B.tolist()
        return ([tokens[b, :lengths[b]].tolist() for b in range(B)], [logps[b, :lengths[b]] for b in range(B)], done)


def process_logits(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """fp32 log-probs of the distribution sampled from: logits / temperature, then the top-p nucleus renormalised.
    Temperature 0 means greedy (the log-probs are then those of temperature 1)."""
    logp = torch.log_softmax(logits_BV / temperature if temperature > 0 else logits_BV, dim=-1)
    if top_p < 1.0:
        sorted_lp, idx = logp.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
        drop = (sorted_lp.exp().cumsum(-1) - sorted_lp.exp()) >= top_p
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, idx, sorted_lp)
        logp = torch.log_softmax(logp, dim=-1)
    return logp


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
                 batch_size: int, vllm_tp: int, vllm_gpu_memory_utilization: float, vllm_sleep_level: int):
    """The sampler of a rank: vLLM engines are seeded per TP group, the fallback sampler per rank."""
    from common.precision import DTYPES
    if kind == "vllm":
        from common.vllm_sampler import VLLMSampler
        return VLLMSampler(model_path, precision, seed + rank // vllm_tp, max_model_len, vllm_tp,
                           vllm_gpu_memory_utilization, vllm_sleep_level)
    return HFSampler(model_path, DTYPES[precision], device, seed + rank, batch_size)

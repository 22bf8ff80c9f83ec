"""The fallback sampler (`--sampler hf`, docs/samplers.md): a plain copy of the policy decoded with a DynamicCache."""
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from common.batches import Rollout


class HFSampler:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, seed: int, batch_size: int = 256):
        self.device, self.batch_size = torch.device(device), batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos], device=self.device)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else int(self.eos_ids[0])
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # this rank's own sampling stream
        # every name the trainer will send, tied weights under both names
        self.params = dict(self.model.named_parameters(remove_duplicate=False))

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        missing = set(self.params)
        for name, t in named_tensors:
            if name in self.params:  # (else a buffer, e.g. rotary inv_freq: derived from the config, not trained)
                self.params[name].copy_(t)
                missing -= {n for n in missing if self.params[n] is self.params[name]}  # tied: sent under one name
        if missing:
            raise RuntimeError(f"weight sync: {len(missing)} sampler parameters not sent, e.g. {sorted(missing)[:3]}")

    def sleep(self) -> None:  # nothing to free between calls: the cache lives only inside generate()
        pass
    wake_up = shutdown = sleep

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0) -> Rollout:
        flat = [p for p in prompts for _ in range(n)]
        out = Rollout()
        for i in range(0, len(flat), self.batch_size):
            chunk = flat[i:i + self.batch_size]
            for rows, new in zip((out.prompt_ids, out.response_ids, out.logprobs, out.finished),
                                 (chunk, *self._generate_batch(chunk, max_new_tokens, temperature, top_p))):
                rows.extend(new)
        return out

    def _sample(self, logits_BV, temperature: float, top_p: float):
        """The next token of every row and its fp32 log-prob under the processed distribution."""
        logp_BV = process_logits(logits_BV.float(), temperature, top_p)
        if temperature > 0:  # argmax of p / Exp(1) noise is a draw from p (multinomial checks p with a host sync)
            tok_B = (logp_BV.exp() / torch.empty_like(logp_BV).exponential_(generator=self.generator)).argmax(-1)
        else:
            tok_B = logp_BV.argmax(-1)
        return tok_B, logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)

    @torch.no_grad()
    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p):
        """Responses, log-probs and end flags of one batch: the prompts left-padded (every row's next token at the same
        column), then one token per step until every row has drawn an end-of-sequence token or max_new_tokens."""
        B, P = len(prompts), max(map(len, prompts))
        input_ids = torch.tensor([[self.pad_id] * (P - len(p)) + list(p) for p in prompts], device=self.device)
        attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # positions count from each row's first real token
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        pos = pos[:, -1:]
        tokens_BT = torch.zeros((B, max_new_tokens), dtype=torch.long, device=self.device)
        logp_BT = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=self.device)
        done_B = torch.zeros(B, dtype=torch.bool, device=self.device)
        length_B = torch.full((B,), max_new_tokens, dtype=torch.long, device=self.device)
        check_every = 16 if self.device.type == "cuda" else 1  # decode steps between checks that every row has ended
        for t in range(max_new_tokens):
            tok_B, lp_B = self._sample(logits, temperature, top_p)
            tokens_BT[:, t], logp_BT[:, t] = tok_B, lp_B
            is_eos = torch.isin(tok_B, self.eos_ids) & ~done_B
            length_B = torch.where(is_eos, t + 1, length_B)
            done_B |= is_eos
            # asking whether every row has ended waits for the GPU (a host sync): there only every 16 tokens
            if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and bool(done_B.all())):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], dim=1)
            pos = pos + 1
            logits = self.model(input_ids=tok_B[:, None], attention_mask=attn, position_ids=pos,
                                past_key_values=cache, use_cache=True).logits[:, -1]
        tokens, logps, lengths = tokens_BT.cpu(), logp_BT.cpu(), length_B.tolist()
        return ([tokens[b, :lengths[b]].tolist() for b in range(B)], [logps[b, :lengths[b]] for b in range(B)],
                done_B.tolist())


def process_logits(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """fp32 log-probs of the distribution sampled from, as vLLM's processed_logprobs: logits / temperature, the top-p
    nucleus renormalised. Temperature 0 is greedy (the log-probs then those of temperature 1)."""
    logp = torch.log_softmax(logits_BV / temperature if temperature > 0 else logits_BV, dim=-1)
    if top_p < 1.0:
        sorted_lp, idx = logp.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
        sorted_lp = sorted_lp.masked_fill((sorted_lp.exp().cumsum(-1) - sorted_lp.exp()) >= top_p, float("-inf"))
        logp = torch.log_softmax(torch.full_like(logp, float("-inf")).scatter(-1, idx, sorted_lp), dim=-1)
    return logp

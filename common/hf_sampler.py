"""The fallback sampler (`--sampler hf`): a plain (unsharded) copy of the policy in the rollout precision, decoded
with transformers, behind the interface of common/sampler.py. The log-prob it reports is the one of the distribution
it sampled from (after temperature and top-p), as vLLM's `processed_logprobs`. On a GPU it decodes with fixed shapes
in a StaticCache and replays each decode step as a CUDA graph (docs/samplers.md says how); `static_cache=False` (the
default on CPU) keeps plain eager DynamicCache decoding.
"""
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from common.batches import Rollout

DECODE_ATTENTION = "rl_grouped_sdpa"  # the attention implementation the static path registers with transformers
CACHE_LEN_MULTIPLE = 256  # static cache lengths are rounded up to this: prompts of similar length share a graph
DONE_CHECK_EVERY = 16  # decode steps between checks that every row has ended (each check is a host sync)


class HFSampler:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, seed: int, batch_size: int = 256,
                 static_cache: bool | None = None, cuda_graph: bool | None = None):
        """static_cache: decode with fixed shapes in a StaticCache (default: on a GPU); cuda_graph: replay each decode
        step as a captured CUDA graph (default: with the static cache on a GPU)."""
        device = torch.device(device)
        self.static_cache = device.type == "cuda" if static_cache is None else static_cache
        self.cuda_graph = self.static_cache and device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph and not (self.static_cache and device.type == "cuda"):
            raise ValueError("cuda_graph needs static_cache and a CUDA device")
        model = None
        if self.static_cache:
            try:
                _register_decode_attention()
                model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                             attn_implementation=DECODE_ATTENTION)
            except (ImportError, ValueError, KeyError) as e:  # a transformers without these APIs: decode as before
                print(f"[sampler] static-cache decoding unavailable ({type(e).__name__}: {str(e)[:300]}); decoding "
                      "with a DynamicCache", flush=True)
                self.static_cache = self.cuda_graph = False
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model = model.to(device).eval()
        self.device, self.batch_size = device, batch_size
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos], device=device)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else int(self.eos_ids[0])
        self.generator = torch.Generator(device=device).manual_seed(seed)  # this rank's own sampling stream
        # every name the trainer will send, tied weights under both names
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        # the decode step passes one mask per layer type; sliding-window layers would need masks of their own
        self.layer_types = sorted(set(getattr(self.model.config, "layer_types", None) or ["full_attention"]))
        if self.static_cache and self.layer_types != ["full_attention"]:
            print(f"[sampler] layer types {self.layer_types}: static-cache decoding supports full attention only; "
                  "decoding with a DynamicCache", flush=True)
            self.static_cache = self.cuda_graph = False
        self._static = None  # the decode state of the current (rows, cache length) bucket

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        missing = set(self.params)
        for name, t in named_tensors:
            if name not in self.params:
                continue  # a buffer (e.g. rotary inv_freq): derived from the config, not trained
            param = self.params[name]
            param.copy_(t)  # in place: a captured decode graph reads these very tensors
            missing -= {n for n in missing if self.params[n] is param}  # a tied weight is sent under one name
        if missing:
            raise RuntimeError(f"weight sync: {len(missing)} sampler parameters not sent, e.g. {sorted(missing)[:3]}")

    def sleep(self) -> None:
        """Free the static cache and the captured graph (the weights stay); the next generate() rebuilds them."""
        if self._static is not None:
            self._static = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        self.sleep()

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

    def _sample(self, logits_BV, temperature: float, top_p: float):
        """The next token of every row and its fp32 log-prob under the processed distribution."""
        logp_BV = process_logits(logits_BV.float(), temperature, top_p)
        if temperature > 0:  # argmax of p / Exp(1) noise is a draw from p (multinomial checks p with a host sync)
            noise_BV = torch.empty_like(logp_BV).exponential_(generator=self.generator)
            tok_B = (logp_BV.exp() / noise_BV).argmax(-1)
        else:
            tok_B = logp_BV.argmax(-1)
        return tok_B, logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)

    def _prefill(self, prompts, rows: int):
        """The prompts left-padded (every row's next token goes at the same column), plus filler rows of one pad token
        up to `rows`, through the model with a DynamicCache. Returns (last logits B x V, cache, attention mask B x P,
        positions B x P)."""
        P = max(map(len, prompts))
        input_ids = torch.full((rows, P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((rows, P), dtype=torch.long)
        for b, p in enumerate(prompts + [[self.pad_id]] * (rows - len(prompts))):
            input_ids[b, P - len(p):] = torch.tensor(p)
            attn[b, P - len(p):] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # positions count from each row's first real token
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits, cache, attn, pos

    @torch.no_grad()
    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p):
        B = len(prompts)
        rows = B
        if self.static_cache:  # a power of two (at most batch_size), so that few shapes occur
            rows = max(B, min(1 << (B - 1).bit_length(), self.batch_size))
        logits, cache, attn, pos = self._prefill(prompts, rows)
        P = attn.shape[1]
        tokens_BT = torch.zeros((rows, max_new_tokens), dtype=torch.long, device=self.device)
        logp_BT = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=self.device)
        done_B = torch.arange(rows, device=self.device) >= B  # filler rows count as done from the start
        length_B = torch.full((rows,), max_new_tokens, dtype=torch.long, device=self.device)
        pos = pos[:, -1:]
        step = None
        if self.static_cache and max_new_tokens > 1:
            step = self._static_decoder(cache, attn, pos, P + max_new_tokens)
            if step is not None:
                cache = None  # its keys and values now live in the static cache
        check_every = DONE_CHECK_EVERY if self.device.type == "cuda" else 1
        for t in range(max_new_tokens):
            tok_B, lp_B = self._sample(logits, temperature, top_p)
            tokens_BT[:, t] = tok_B
            logp_BT[:, t] = lp_B
            is_eos = torch.isin(tok_B, self.eos_ids) & ~done_B
            length_B = torch.where(is_eos, t + 1, length_B)
            done_B |= is_eos
            # asking whether every row has ended waits for the GPU: there only every DONE_CHECK_EVERY tokens
            if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and bool(done_B.all())):
                break
            if step is not None:
                logits = step(tok_B, P + t)
            else:
                attn = torch.cat([attn, torch.ones((rows, 1), dtype=attn.dtype, device=self.device)], dim=1)
                pos = pos + 1
                logits = self.model(input_ids=tok_B[:, None], attention_mask=attn, position_ids=pos,
                                    past_key_values=cache, use_cache=True).logits[:, -1]
        tokens, logps, lengths, done = tokens_BT.cpu(), logp_BT.cpu(), length_B.tolist(), done_B.tolist()
        return ([tokens[b, :lengths[b]].tolist() for b in range(B)], [logps[b, :lengths[b]] for b in range(B)],
                done[:B])

    # --- the static-shape decode step ------------------------------------------------------------------------------

    def _static_decoder(self, prefill_cache, attn_BP, pos_B1, length: int):
        """Move the prefilled keys and values into the bucket's StaticCache and return step(tok_B, slot) -> logits
        B x V, which decodes one token (written at cache slot `slot`) by replaying the graph or eagerly. Returns None,
        after saying why, where the static path does not work with this transformers version (decoding then goes on
        with the DynamicCache)."""
        rows, P = attn_BP.shape
        cache_len = -(-length // CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE
        try:
            st = self._static_state(rows, cache_len)
            st.cache.reset()  # zeros in place: the graph keeps the tensors' addresses
            for i, layer in enumerate(prefill_cache.layers):
                st.cache.update(layer.keys, layer.values, i)  # written at slots 0..P-1
            filled = int(st.cache.get_seq_length())  # one sync per batch: guards the slot arithmetic below
            if filled != P:
                raise RuntimeError(f"StaticCache holds {filled} tokens after a {P}-token prefill")
        except torch.cuda.OutOfMemoryError:
            raise  # the cache is rows x (prompt + max_new_tokens) tokens: lower the sampler's batch size
        except Exception as e:  # noqa: BLE001 -- an API this code does not know: decode as before, and say so
            print(f"[sampler] static-cache decoding unavailable ({type(e).__name__}: {str(e)[:300]}); decoding with "
                  "a DynamicCache", flush=True)
            self.sleep()
            self.static_cache = self.cuda_graph = False
            return None
        st.mask.fill_(float("-inf"))
        st.mask[:, 0, 0, :P].masked_fill_(attn_BP.bool(), 0.0)
        st.pos.copy_(pos_B1)

        def step(tok_B, slot: int):
            st.ids.copy_(tok_B[:, None])
            st.pos.add_(1)
            st.mask[:, 0, 0, slot] = 0.0  # the new token sees itself and every earlier real token
            if st.graph is not None:
                st.graph.replay()
                return st.logits
            return self._decode_forward(st)
        return step

    def _decode_forward(self, st):
        return self.model(input_ids=st.ids, position_ids=st.pos, past_key_values=st.cache, use_cache=True,
                          attention_mask={kind: st.mask for kind in self.layer_types}).logits[:, -1]

    def _static_state(self, rows: int, cache_len: int):
        """The decode state of a (rows, cache length) bucket: made, and with CUDA graphs captured, on first use. One
        bucket is kept at a time (each holds a whole KV cache)."""
        if self._static is not None and self._static.key == (rows, cache_len):
            return self._static
        self.sleep()
        st = _DecodeState((rows, cache_len), StaticCache(config=self.model.config, max_cache_len=cache_len),
                          ids=torch.full((rows, 1), self.pad_id, dtype=torch.long, device=self.device),
                          pos=torch.zeros((rows, 1), dtype=torch.long, device=self.device),
                          # additive, in the model's dtype (what sdpa would make of a boolean mask in every layer)
                          mask=torch.full((rows, 1, 1, cache_len), float("-inf"), dtype=self.model.dtype,
                                          device=self.device))
        if self.cuda_graph:
            failure = None
            try:
                self._capture(st)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 -- any capture failure: decode eagerly instead, and say so
                failure = f"{type(e).__name__}: {str(e)[:300]}"
            if failure is not None:  # (out of the except block, whose traceback holds the failed state's tensors)
                print(f"[sampler] CUDA graph capture failed ({failure}); decoding without graphs", flush=True)
                self.cuda_graph = False
                st = None
                return self._static_state(rows, cache_len)
        self._static = st
        return st

    def _capture(self, st) -> None:
        """Capture one decode step. The cache's tensors are allocated by a first (eager) step, then two warm-up steps
        run on a side stream as the CUDA-graph recipe asks (cuBLAS workspaces, allocator pools), then the capture and
        one checking replay. These steps write junk into the first cache slots: every batch resets the cache."""
        st.mask[:, 0, 0, :5] = 0.0
        self._decode_forward(st)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_forward(st)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            st.logits = self._decode_forward(st)
        # the graph must advance the cache's own length (a device tensor); a length kept as a Python int would be
        # frozen into the graph, and every replay would overwrite the same slot
        before = int(st.cache.get_seq_length())
        graph.replay()
        if int(st.cache.get_seq_length()) != before + 1:
            raise RuntimeError("a replay did not advance the StaticCache's length")
        st.graph = graph


class _DecodeState:
    """Everything one static-shape decode step reads and writes; the graph replays on exactly these tensors."""

    def __init__(self, key, cache, ids, pos, mask):
        self.key, self.cache, self.ids, self.pos, self.mask = key, cache, ids, pos, mask  # ids, pos: B x 1
        self.graph, self.logits = None, None  # the captured step and its output (B x V, in the graph's memory)


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """sdpa for one query token with grouped-query attention: query B x H x 1 x D is viewed as B x KV x (H/KV) x D
    (head h uses key-value head h // (H/KV), as in transformers' repeat_kv), so the cache B x KV x S x D is read once
    rather than copied H/KV times. Prefill (more than one query token) goes to transformers' sdpa unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, L, D = query.shape
    groups = getattr(module, "num_key_value_groups", 1)
    if L != 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q = query.reshape(B, H // groups, groups, D)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None  # B x 1 x H x D, as transformers expects


def _register_decode_attention() -> None:
    """Register grouped_decode_attention under DECODE_ATTENTION, with sdpa's mask (used by the prefill)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


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


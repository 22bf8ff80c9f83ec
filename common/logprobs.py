"""Trainer-side log-probs of sampled tokens, in fp32, without ever holding a micro-batch's full fp32 logits (at 16K
tokens and a vocabulary of 152K, 10 GB): chunks of tokens, each checkpointed under gradient (docs/algorithms.md)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, noop_context_fn
from transformers.masking_utils import create_causal_mask


def _chunk_logprobs(hidden_NH, weight_VH, targets_N, temperature: float, with_entropy: bool):
    logits_NV = F.linear(hidden_NH, weight_VH).float() / temperature  # fp32 from here on
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    logp_N = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
    if not with_entropy:
        return logp_N, None
    with torch.no_grad():  # a metric, never differentiated: with a graph, the checkpoint's recompute would keep each
        entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)  # chunk's fp32 log-softmax alive until the backward ends
    return logp_N, entropy_N


def chunked_logprobs(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, temperature: float,
                     chunk_size: int, with_entropy: bool = False, chunk_fn=_chunk_logprobs, context_fn=noop_context_fn):
    """log softmax(hidden @ weight.T / temperature)[target] in fp32, `chunk_size` tokens at a time by `chunk_fn`, each
    chunk checkpointed with `context_fn` (exact.py passes its own of both). Returns (logp_N, entropy_N or None)."""
    grad = torch.is_grad_enabled() and hidden_NH.requires_grad
    logps, ents = [], []
    for i in range(0, hidden_NH.shape[0], chunk_size):
        args = (hidden_NH[i:i + chunk_size], weight_VH, targets_N[i:i + chunk_size], temperature, with_entropy)
        lp, ent = checkpoint(chunk_fn, *args, use_reentrant=False, context_fn=context_fn) if grad else chunk_fn(*args)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = hidden_NH.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


class PolicyModel(nn.Module):
    """A Hugging Face causal LM whose forward returns the response tokens' log-probs; the FSDP2 root (load_sharded).
    `self.lm` keeps the Hugging Face names (checkpoints, weight sync); `self.exact`: None, or exact mode's forward."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.exact = None

    def forward(self, input_ids_BL, attention_mask_BL, response_mask_BT, temperature: float, chunk_size: int,
                with_entropy: bool = False):
        """input_ids_BL: prompt + response, right-padded; response_mask_BT: 1 on the response tokens, left-aligned.
        Returns (logp_BT, entropy_BT or None), fp32, 0 off-mask."""
        if self.exact is None:
            hidden_NH, targets_N = response_hidden(self.lm, input_ids_BL, attention_mask_BL, response_mask_BT)
            chunk_fn, context_fn = _chunk_logprobs, noop_context_fn
        else:
            hidden_NH, targets_N = self.exact.response_hidden(self.lm, input_ids_BL, attention_mask_BL,
                                                              response_mask_BT)
            chunk_fn, context_fn = self.exact.chunk_logprobs, self.exact.checkpoint_context
        logp_N, ent_N = chunked_logprobs(hidden_NH, self.lm.lm_head.weight, targets_N, temperature, chunk_size,
                                         with_entropy, chunk_fn, context_fn)
        logp_BT = torch.zeros(response_mask_BT.shape, dtype=torch.float32, device=logp_N.device)
        logp_BT = logp_BT.masked_scatter(response_mask_BT, logp_N)  # row-major order matches on both sides
        ent_BT = torch.zeros_like(logp_BT).masked_scatter(response_mask_BT, ent_N) if with_entropy else None
        return logp_BT, ent_BT


def recompute_logprobs(model: PolicyModel, rollout, groups: list[list[int]], pad_id: int, temperature: float,
                       chunk_size: int, device, stats=None) -> list[torch.Tensor]:
    """Step 3 of every script: the trainer's log-probs of each response of `rollout` (a Rollout), without gradients,
    by the micro-batches `groups` (common.batches.micro_batches), and train/entropy, the mean over response tokens,
    into stats (None: no entropy, as for the frozen reference). Returns one fp32 CPU tensor per response."""
    logp = [None] * len(rollout.response_ids)
    with torch.no_grad():
        for mb in groups:
            ids, attn, rmask = rollout.rows(mb, pad_id, device)
            logp_BT, ent_BT = model(ids, attn, rmask, temperature, chunk_size, with_entropy=stats is not None)
            if stats is not None:
                stats.add("train/entropy", ent_BT[rmask].sum(), rmask.sum())
            logp_BT = logp_BT.cpu()  # one device-to-host copy per micro-batch, not one per row
            for row, i in enumerate(mb):
                logp[i] = logp_BT[row, :len(rollout.response_ids[i])]
    return logp


def response_hidden(lm: nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor,
                    response_mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_NH, targets_N): the final hidden states that predict the response tokens of the right-padded
    prompt+response rows (position j predicts token j+1), and those tokens, in row-major order."""
    seq_len_B, resp_len_B = attention_mask_BL.sum(-1), response_mask_BT.sum(-1)
    pos_L = torch.arange(attention_mask_BL.shape[1], device=attention_mask_BL.device)
    is_resp_BL = (pos_L[None] >= (seq_len_B - resp_len_B)[:, None]) & (pos_L[None] < seq_len_B[:, None])
    embeds_BLH = lm.get_input_embeddings()(input_ids_BL)
    # the model's own mask, never dropped: from the 2-D mask Hugging Face drops that of a micro-batch without padding
    # (SDPA's is_causal), which under torch.compile is a graph of its own, a recompile at the step that first has one
    mask = create_causal_mask(lm.config, embeds_BLH, attention_mask_BL, None, allow_is_causal_skip=False)
    hidden_BLH = lm.model(inputs_embeds=embeds_BLH, attention_mask=mask, use_cache=False).last_hidden_state
    return hidden_BLH[:, :-1][is_resp_BL[:, 1:]], input_ids_BL[:, 1:][is_resp_BL[:, 1:]]


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device):
    """Right-padded prompt+response rows. Returns input_ids_BL, attention_mask_BL, response_mask_BT (bool)."""
    rows = [p + r for p, r in zip(prompts, responses)]
    L, T = max(map(len, rows)), max(1, max(map(len, responses)))
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    resp_mask = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, (row, r) in enumerate(zip(rows, responses)):
        input_ids[i, :len(row)] = torch.tensor(row)
        attn[i, :len(row)] = 1
        resp_mask[i, :len(r)] = True
    return to_device(input_ids, device), to_device(attn, device), to_device(resp_mask, device)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor onto `device` without waiting for the GPU: a copy from pageable host memory first waits for every
    kernel queued before it (as CUDA documents); one from pinned memory is queued like a kernel: the host goes on."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pad_float(rows: list[torch.Tensor], T: int, device) -> torch.Tensor:
    """Left-aligned, zero-padded B x T fp32 tensor from per-sequence 1-D tensors."""
    out = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out.to(device)


def _pack(order: list[int], lengths: list[int], token_budget: int) -> list[list[int]]:
    """Rows in `order` (longest first), each micro-batch filled while rows x its first row fits (a longer row alone)."""
    groups = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_microbatches(lengths: list[int], token_budget: int, min_count: int = 1) -> list[list[int]]:
    """Sequence indices, longest first (little padding), in as few micro-batches as fit `token_budget` (padded size:
    rows x longest row; a longer row alone), at least `min_count`, and even: packed to the smallest budget that needs
    no more of them, so that no row or two is left over for the last (under torch.compile a one-row micro-batch, and a
    small one, is a graph of its own: a recompile at whatever step first has one). `min_count`: under FSDP every rank
    must run as many forwards and backwards (each a collective), so the caller passes the maximum over ranks."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    count = max(len(_pack(order, lengths, token_budget)), min_count)
    lo, hi = 1, max(token_budget, 1)  # the count only falls as the budget grows: bisect for the smallest that fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_pack(order, lengths, mid)) <= count else (mid + 1, hi)
    groups = _pack(order, lengths, lo)
    while len(groups) < min_count:  # split the largest group in two (needs min_count <= len(lengths))
        j = max(range(len(groups)), key=lambda k: len(groups[k]))
        if len(groups[j]) < 2:
            raise ValueError(f"cannot make {min_count} micro-batches from {len(lengths)} sequences")
        g = groups.pop(j)
        groups[j:j] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups

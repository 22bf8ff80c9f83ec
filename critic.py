"""PPO's value model, the critic: the policy's language model plus a scalar value head on its last hidden states,
built from the policy's weights (or from a checkpoint's critic/ part), sharded as the policy (FSDP2), and saved in a
checkpoint's critic/ part, the head as value_head.safetensors. The math: docs/algorithms.md, "The critic"."""
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from common import logprobs
from common.fsdp import full_tensor, load_sharded


class CriticModel(nn.Module):
    """`lm`: a Hugging Face causal LM (lm_head unused); `value_head`: nn.Linear(hidden, 1) on its last hidden states."""

    def __init__(self, lm: nn.Module, value_head: nn.Linear):
        super().__init__()
        self.lm = lm
        self.value_head = value_head

    def forward(self, input_ids_BL, attention_mask_BL, response_mask_BT):
        """As PolicyModel.forward; returns values_BT, fp32, 0 off-mask: V(s_t) where the logits predict token t."""
        hidden_NH, _ = logprobs.response_hidden(self.lm, input_ids_BL, attention_mask_BL, response_mask_BT)
        # the head's product in fp32 (its weights arrive in the compute dtype): values are never rounded to 16 bits
        w, b = self.value_head.weight, self.value_head.bias
        values_N = F.linear(hidden_NH.float(), w.float(), b.float()).squeeze(-1)
        values_BT = torch.zeros(response_mask_BT.shape, dtype=torch.float32, device=values_N.device)
        return values_BT.masked_scatter(response_mask_BT, values_N)  # row-major order matches on both sides

    @torch.no_grad()
    def values(self, rollout, groups: list[list[int]], pad_id: int, device) -> list[torch.Tensor]:
        """V_old without gradient, micro-batch by micro-batch (`groups`): a fp32 CPU tensor per sequence's response."""
        values = [None] * len(rollout.response_ids)
        for mb in groups:
            for i, row in zip(mb, self(*rollout.rows(mb, pad_id, device)).cpu()):
                values[i] = row[:len(rollout.response_ids[i])]
        return values


def init_value_head(hidden_size: int, seed: int) -> nn.Linear:
    """weight ~ N(0, (1/(hidden+1))^2), bias 0 (OpenRLHF's), from its own generator: the same head on every rank."""
    head = nn.Linear(hidden_size, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (hidden_size + 1), generator=g)
        head.bias.zero_()
    return head


def load_critic(path: str, param_dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool, seed: int,
                attn_implementation: str = "sdpa", cpu_offload: bool = False, compile: bool = False) -> CriticModel:
    """The CriticModel (the FSDP2 root, sharded as load_policy does) from the model directory `path`, the policy's or a
    critic checkpoint's (then with its value_head.safetensors; else a fresh head from `seed`)."""
    def wrap(lm):
        head = init_value_head(lm.config.hidden_size, seed)
        file, old = os.path.join(path, "value_head.safetensors"), os.path.join(path, "trainer_state.json")
        try:
            if os.path.isfile(file):  # a critic checkpoint's (ValueHeadState)
                head.load_state_dict(load_file(file))
            elif os.path.isfile(old):  # an older version kept the head there as JSON: read once (a save rewrites it)
                with open(old) as f:
                    saved = json.load(f).get("value_head")
                if saved is not None:
                    file = old
                    head.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in saved.items()})
        except Exception as e:  # noqa: BLE001 -- SafetensorError, or a head of another shape
            raise ValueError(f"--resume: {file} is damaged: its value_head is not this critic's ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]})") from None
        # an untied lm_head gets no gradient: frozen, else a resume asks the checkpoint for AdamW state it never had
        if lm.get_output_embeddings().weight is not lm.get_input_embeddings().weight:
            lm.get_output_embeddings().weight.requires_grad_(False)
        return CriticModel(lm, head)  # the FSDP root: embedding, final norm, (unused) lm_head, value head
    return load_sharded(path, wrap, param_dtype, device, gradient_checkpointing, attn_implementation, cpu_offload,
                        compile)


class ValueHeadState:
    """The value head as a checkpoint's state, value_head.safetensors (load_critic reads it back as it builds)."""

    def __init__(self, critic: CriticModel):
        self.critic = critic

    @torch.no_grad()
    def state_dict(self) -> dict:  # a collective under FSDP2: every rank calls it
        return {name: full_tensor(p).float().cpu() for name, p in self.critic.value_head.named_parameters()}

    def load_state_dict(self, state: dict) -> None:
        pass

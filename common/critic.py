"""The value model of PPO (the critic, docs/algorithms.md) and how its value head travels through checkpoints. The
value loss lives in ppo.py."""
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.fsdp import full_tensor, load_sharded
from common.logprobs import response_hidden


class CriticModel(nn.Module):
    """`lm`: a Hugging Face causal LM (its lm_head is not used, and frozen when untied; keeping it makes the critic's
    checkpoint an ordinary model directory, like the policy's). `value_head`: nn.Linear(hidden, 1) on the final hidden
    states. The FSDP2 root (load_sharded)."""

    def __init__(self, lm: nn.Module, value_head: nn.Linear):
        super().__init__()
        self.lm = lm
        self.value_head = value_head

    def forward(self, input_ids_BL, attention_mask_BL, response_mask_BT):
        """Same inputs and layout as PolicyModel.forward. Returns values_BT, fp32, 0 off-mask: values_BT[b, t] is
        V(s_t), the value of the state (prompt + response tokens < t) from which response token t is generated, read
        at the same position as the logits that predict token t."""
        hidden_NH, _ = response_hidden(self.lm, input_ids_BL, attention_mask_BL, response_mask_BT)
        # the head's product in fp32 (its weights arrive in the compute dtype): values are never rounded to 16 bits
        w, b = self.value_head.weight, self.value_head.bias
        values_N = F.linear(hidden_NH.float(), w.float(), b.float()).squeeze(-1)
        values_BT = torch.zeros(response_mask_BT.shape, dtype=torch.float32, device=values_N.device)
        return values_BT.masked_scatter(response_mask_BT, values_N)  # row-major order matches on both sides


def init_value_head(hidden_size: int, seed: int) -> nn.Linear:
    """weight ~ N(0, (1/(hidden+1))^2), bias 0, as OpenRLHF's critic (openrlhf/models/model.py, init_value_head):
    initial values near 0 with a little per-state spread. Drawn from its own generator seeded with `seed`, so every
    rank builds the same head whatever else consumed the global random stream."""
    head = nn.Linear(hidden_size, 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (hidden_size + 1), generator=g)
        head.bias.zero_()
    return head


def load_critic(path: str, param_dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool, seed: int,
                attn_implementation: str = "sdpa", cpu_offload: bool = False, compile: bool = False) -> CriticModel:
    """Load fp32 master weights from the model directory `path` (the policy's, or a critic checkpoint), add the value
    head (from `path`'s trainer_state.json when it is a critic checkpoint, else a fresh one from `seed`), shard with
    FSDP2 as load_policy does and return the CriticModel (the FSDP root)."""
    def wrap(lm):
        head = init_value_head(lm.config.hidden_size, seed)
        saved = saved_value_head(path)
        if saved is not None:
            head.load_state_dict({name: torch.tensor(v, dtype=torch.float32) for name, v in saved.items()})
        # an untied lm_head is never used by the critic: frozen, so that no optimizer holds it (AdamW would keep no
        # state for a weight that gets no gradient, while a resumed run's fresh optimizer asks the checkpoint for its
        # state: "Missing key ... lm.lm_head.weight.step"). Tied, it is the embedding, which the critic trains
        if lm.get_output_embeddings().weight is not lm.get_input_embeddings().weight:
            lm.get_output_embeddings().weight.requires_grad_(False)
        return CriticModel(lm, head)  # the FSDP root: embedding, final norm, (unused) lm_head, value head
    return load_sharded(path, wrap, param_dtype, device, gradient_checkpointing, attn_implementation, cpu_offload,
                        compile)


# The value head is not part of the Hugging Face model, so save_checkpoint (which writes the `lm` child) does not
# write it. Its hidden + 1 floats go into the critic checkpoint's trainer_state.json instead: written atomically with
# the rest, and exact (JSON keeps a double's shortest round-trip repr, and every fp32 is a double).

@torch.no_grad()
def value_head_state(critic: CriticModel) -> dict:
    """The full value head as JSON-able lists. A collective under FSDP2: every rank calls it."""
    return {name: full_tensor(p).float().cpu().tolist() for name, p in critic.value_head.named_parameters()}


def saved_value_head(path: str) -> dict | None:
    """The value head stored in `path`/trainer_state.json by value_head_state, or None (e.g. `path` is the policy's
    model directory)."""
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_file):
        return None
    with open(state_file) as f:
        return json.load(f).get("value_head")

"""Checks to fail early with one line, not late with a traceback: model directory, shared run directory, overflow."""
import functools
import json
import math
import os
import secrets

import torch
import torch.distributed as dist
from safetensors import safe_open

from common.dist import reduce_stats
from common.fsdp import decoder_layers
from common.logprobs import collate
from common.precision import DTYPES, precision_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # any one: fast, sentencepiece, BPE


def not_json(e: json.JSONDecodeError | UnicodeDecodeError) -> str:
    """Where a JSON file stops being JSON or UTF-8, for a message."""
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON ({e.msg} at line {e.lineno} column {e.colno})"
    return f"not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"


def check_model_dir(path: str, flag: str = "--model") -> None:
    """Fail before anything loads on a path that cannot be a Hugging Face model directory; flag names it (--resume)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag} {path!r}: no such directory (give a local Hugging Face model directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{flag} {path!r}: no config.json there, not a Hugging Face model directory")
    if not os.access(os.path.join(path, "config.json"), os.R_OK):
        raise PermissionError(f"{flag} {path!r}: config.json is not readable")
    # without them AutoTokenizer builds an empty tokenizer, silently, and the run crashes later inside the model
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{flag} {path!r}: no tokenizer files there ({', '.join(TOKENIZER_FILES)}); save "
                                "the tokenizer into the model directory (tokenizer.save_pretrained)")
    # the configs, tokenizer and index: a damaged one otherwise fails inside transformers with a traceback
    for name in sorted(os.listdir(path)):
        if name.endswith(".json") and os.path.isfile(os.path.join(path, name)):
            try:
                with open(os.path.join(path, name), encoding="utf-8") as f:
                    json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{flag} {path!r}: {name} is damaged: {not_json(e)}") from None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{flag} {path!r}: model.safetensors.index.json has no readable weight_map") from None
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{flag} {path!r}: {name}, listed in model.safetensors.index.json, is missing")
    else:
        files = [name for name in ("model.safetensors",) if os.path.isfile(os.path.join(path, name))]
    for name in files:  # safetensors reads the header: a length past the file, a garbled header, data short of it
        try:
            with safe_open(os.path.join(path, name), "pt"):
                pass
        except Exception as e:  # noqa: BLE001 -- safetensors' SafetensorError and whatever else a damaged file raises
            detail = " ".join(str(e).split()).removeprefix("Error while deserializing header: ")[:200]
            raise ValueError(f"{flag} {path!r}: {name} is not a complete safetensors file "
                             f"({os.path.getsize(os.path.join(path, name)):,} bytes; safetensors: {detail}): an "
                             "interrupted copy or download?") from None


def check_shared_dir(path: str, device) -> None:
    """Collective. ValueError on every rank when one does not see a file rank 0 wrote into `path` (docs/scale.md)."""
    if dist.get_world_size() == 1:
        return
    token = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = os.path.join(path, f".shared_check_{token[0]}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write(token[0])
    dist.barrier()
    try:
        with open(probe) as f:
            seen = f.read() == token[0]
    except OSError:
        seen = False
    blind = reduce_stats({"blind": float(not seen)}, "sum", device)["blind"]
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(probe)
    if blind:
        raise ValueError(f"the run directory {path!r} is not on a filesystem every rank sees ({int(blind)} of "
                         f"{dist.get_world_size()} ranks do not see rank 0's files): checkpoints are written by "
                         "every rank into one directory, so give --run-dir on a shared filesystem")


@torch.no_grad()
def check_forward_range(model, prompts: list[list[int]], pad_id: int, device, train: torch.dtype,
                        rollout: torch.dtype, chunk_size: int) -> dict:
    """Collective: the largest |activation| after the embedding and each decoder layer on this rank's first prompts,
    {layer: peak over all ranks}; ValueError past the train or rollout precision (docs/algorithms.md, Range checks)."""
    lm = model.lm
    named = [(f"{lm.base_model_prefix}.embed_tokens", lm.get_input_embeddings())]
    named += [(f"{lm.base_model_prefix}.layers.{i}", layer) for i, layer in enumerate(decoder_layers(lm))]
    peaks = {name: 0.0 for name, _ in named}

    def record(name, module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        peak = out.detach().abs().max().float()
        peaks[name] = max(peaks[name], peak.item() if torch.isfinite(peak) else float("inf"))
    handles = [m.register_forward_hook(functools.partial(record, name)) for name, m in named]
    try:
        rows = [p for p in prompts if len(p) >= 2] or [[pad_id, pad_id]]
        ids, attn, rmask = collate([p[:-1] for p in rows], [p[-1:] for p in rows], pad_id, device)
        logp_BT, _ = model(ids, attn, rmask, 1.0, chunk_size)
        finite = bool(torch.isfinite(logp_BT[rmask]).all())
    finally:
        for h in handles:
            h.remove()
    peaks = reduce_stats({**peaks, "nonfinite": float(not finite)}, "max", device)  # (one collective)
    finite = peaks.pop("nonfinite") == 0
    top = max(peaks.values())
    fmax = {name: torch.finfo(dtype).max for name, dtype in DTYPES.items()}
    for side, dtype in (("training", train), ("rollouts", rollout)):
        prec = precision_name(dtype)
        first = next((n for n, _ in named if peaks[n] >= fmax[prec]), None)  # (peaks' keys are sorted now)
        if first is None and side == "training" and not finite:
            first = "the log-prob head"
        # with a finite peak, the formats that hold it; past the train precision's range, the wider formats
        fits = [p for p, m in fmax.items() if (top < m if math.isfinite(top) else m > fmax[prec])]
        if first is not None:
            raise ValueError(f"the model's forward overflows {prec} ({side}): activations reach "
                             f"{peaks[first]:.3g} at {first} on the first batch (largest {prec} value "
                             f"{fmax[prec]:.5g}); precisions whose range holds them: "
                             f"{', '.join(fits) or 'none'} (--train-precision / --rollout-precision)")
    return peaks

"""common/fsdp.py: the trainer's model as the scripts load it. Dropout is off although the forwards run in train
mode (gradient checkpointing acts only there)."""
import json
import os
import subprocess
import sys

import torch

from conftest import make_tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dropout_off_in_the_trainer(tmp_path, process_group):
    """A checkpoint whose config sets attention dropout: two train-mode forwards of the same batch give the same
    log-probs, those of the model without dropout (with dropout on they differed by nats)."""
    from common.fsdp import load_policy
    from common.logprobs import collate
    _, _, device = process_group
    path = make_tiny_model_dir(str(tmp_path / "m"), attention_dropout=0.5)
    model = load_policy(path, torch.float32, device, gradient_checkpointing=True)
    assert model.lm.config.attention_dropout == 0.0
    model.train()
    ids, attn, rmask = collate([[4, 5, 13, 6, 14], [7, 14]], [[5, 6, 7, 1], [8, 9]], 0, device)
    with torch.no_grad():
        a, _ = model(ids, attn, rmask, 1.0, 16)
        b, _ = model(ids, attn, rmask, 1.0, 16)
        model.eval()
        c, _ = model(ids, attn, rmask, 1.0, 16)
    assert torch.equal(a, b) and torch.allclose(a, c, atol=1e-6)


def torchrun(nproc, check, path, out):
    """tests/multirank.py's `check` on `nproc` ranks; returns what each rank's check returned, by rank."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    os.makedirs(out, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        "tests/multirank.py", check, path, out], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nproc)]


def test_weight_sync_gathers_each_tensor_once_in_the_rollout_precision(tmp_path):
    """2 ranks, a tied model, a bf16 rollout: each rank puts its bf16 shard of every distinct tensor into the
    all-gathers (the fp32 masters, and the tied embedding under both names, once moved 2.x times the bytes)."""
    path = make_tiny_model_dir(str(tmp_path / "m"))
    for r in torchrun(2, "sync_bytes", path, str(tmp_path / "out")):
        assert "lm_head.weight" not in r["names"] and "model.embed_tokens.weight" in r["names"]
        assert r["bytes"] <= 1.05 * r["bf16_shard_bytes"], r  # (shards are padded to equal sizes)

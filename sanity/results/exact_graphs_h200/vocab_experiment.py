"""Which property of the tiny grpo test model leaves unequal tokens in exact mode: its 42-token vocabulary (vLLM pads
it to 64) or its depth/shape. grpo.py --exact, bf16, 3 steps, the recompute every step, for 4-layer models of the 1.5B
layer shape with vocabularies 42, 64 and 128 (the character tokenizer in every case)."""
import json
import os
import subprocess
import sys

sys.path.insert(0, "tests")
from test_exact_gpu import SHAPES, build_model  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
data = os.path.join(out, "add.jsonl")
with open(data, "w") as f:
    f.write("".join(json.dumps({"problem": f"{a}+{a * 7 % 90}=", "answer": str(a + a * 7 % 90)}) + "\n"
                    for a in range(10, 74)))
family, _, dims = SHAPES["1.5b"]
for vocab in (42, 64, 128):
    model = build_model(os.path.join(out, f"m{vocab}"), family, vocab, **{**dims, "num_hidden_layers": 4})
    run = os.path.join(out, f"run{vocab}")
    cmd = [sys.executable, "grpo.py", "--exact", "--sampler", "vllm", "--model", model, "--dataset", data,
           "--prompt-template", "{problem}", "--reward", "exact", "--precision", "bf16", "--num-steps", "3",
           "--num-prompts", "16", "--group-size", "8", "--max-response-len", "256", "--max-prompt-len", "32",
           "--lr", "1e-4", "--save-every", "0", "--eval-every", "0", "--exact-check-every", "1",
           "--vllm-kv-cache-gib", "4", "--run-dir", run]
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(f"vocab {vocab}: exit {p.returncode}", flush=True)
    if p.returncode:
        print(p.stderr[-2000:])
        continue
    for line in open(os.path.join(run, "metrics.jsonl")):
        r = json.loads(line)
        if "mismatch/kl_k3" in r:
            print(f"  step {r['step']}: unequal {r['mismatch/unequal_tokens']:.0f} of "
                  f"{r['train/response_len_mean'] * 128:.0f}, max |diff| {r['mismatch/logp_abs_diff_max']:.3g}, "
                  f"len mean {r['train/response_len_mean']:.1f}", flush=True)

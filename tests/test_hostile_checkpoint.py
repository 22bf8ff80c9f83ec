"""What a hostile or damaged checkpoint does to a resume (docs/faults.md, "A damaged or foreign checkpoint"): a file
that no checkpoint of ours holds is refused before anything is read (torch would unpickle a rank's own DCP metadata
when the checkpoint's .metadata does not load); .metadata of the wrong shape is refused; ppo.py's critic/ gets the
checks of the policy's part; trainer_state.json and rng_rank{r}.json of the wrong shape are one line naming the file;
a --num-steps that leaves nothing to train is refused before anything moves. The scripts run in this process on the
built-in task, on CPU (test_hostile_input.py's helpers)."""
import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_hostile_input import B, damage, files, main, refused

STEP1, STEP2 = os.path.join("checkpoints", "step_000001"), os.path.join("checkpoints", "step_000002")


class RunsCodeThenLoads:
    """A pickle that creates the directory `marker`, then returns the object that `real` (a pickle's bytes) holds:
    the checkpoint then loads as if nothing happened."""

    def __init__(self, marker, real):
        self.marker, self.real = marker, real

    def __reduce__(self):
        return (eval, (f"__import__('os').makedirs({self.marker!r}) or __import__('pickle').loads({self.real!r})",))


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory, process_group):
    """{script: a run of it, 2 steps with a checkpoint after each} for grpo.py and ppo.py."""
    out = {}
    for name in ("grpo.py", "ppo.py"):
        out[name] = str(tmp_path_factory.mktemp(name.removesuffix(".py")) / "run")
        main(name, "--run-dir", out[name], *B, "--num-steps", "2", "--save-every", "1", "--keep-last", "0")
    return out


@pytest.fixture
def copy_of(finished_runs, tmp_path):
    """copy_of(script): a copy of its finished run, to damage or resume."""
    return lambda name: shutil.copytree(finished_runs[name], str(tmp_path / name.removesuffix(".py")))


def resume(name, run_dir, *flags):
    """main() resuming run_dir's latest checkpoint for a step more; its one-line error, or None."""
    try:
        main(name, "--run-dir", run_dir, *B, "--num-steps", "3", "--resume", "latest", *flags)
    except (ValueError, FileNotFoundError) as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------------------------
# A pickle torch would read, which no checkpoint of ours holds


@pytest.mark.parametrize("name,part", [("grpo.py", ""), ("ppo.py", ""), ("ppo.py", "critic")])
def test_a_planted_rank_metadata_is_refused_before_torch_reads_it(copy_of, tmp_path, name, part):
    """.metadata that passes the metadata check but that torch cannot take (storage_meta an int: torch 2.13 sets its
    load_id), and a pickle in __0.metadata, which torch then reads instead. Before: the marker appeared, and the
    resume went on with the real metadata (exit 0, the same metrics)."""
    run_dir, marker = copy_of(name), str(tmp_path / "pwned")
    optimizer = os.path.join(run_dir, STEP2, part, "optimizer")
    with open(os.path.join(optimizer, ".metadata"), "rb") as f:
        real = f.read()  # (our own run's: plain pickle.loads is safe here)
    metadata = pickle.loads(real)
    metadata.storage_meta = 1
    with open(os.path.join(optimizer, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with open(os.path.join(optimizer, "__0.metadata"), "wb") as f:
        pickle.dump(RunsCodeThenLoads(marker, real), f)
    before = files(run_dir)
    error = resume(name, run_dir)
    assert not os.path.exists(marker)
    assert error is not None and error.startswith(f"--resume: {optimizer}/__0.metadata: no checkpoint holds such a "
                                                  "file; refused"), error
    assert files(run_dir) == before


def test_torch_reads_the_metadata_through_the_check_and_never_a_rank_metadata(finished_runs, tmp_path):
    """Beside the refusal above: the reader that load_training_state gives torch reads .metadata as the check does
    (whatever is there by the time torch reads it) and never __<rank>.metadata, which torch 2.13 asks for when
    .metadata does not load."""
    from common.checkpoint import CheckedReader, UnsafeCheckpoint
    optimizer, marker = os.path.join(shutil.copytree(finished_runs["grpo.py"], str(tmp_path / "run")), STEP2,
                                     "optimizer"), str(tmp_path / "pwned")
    with open(os.path.join(optimizer, ".metadata"), "rb") as f:
        real = f.read()
    with open(os.path.join(optimizer, "__0.metadata"), "wb") as f:
        pickle.dump(RunsCodeThenLoads(marker, real), f)
    assert CheckedReader(optimizer).read_metadata(rank=0).storage_data == pickle.loads(real).storage_data
    with open(os.path.join(optimizer, ".metadata"), "wb") as f:
        pickle.dump(RunsCodeThenLoads(marker, real), f)
    for rank in (None, 0):
        with pytest.raises(UnsafeCheckpoint, match="names builtins.eval"):
            CheckedReader(optimizer).read_metadata(rank=rank)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("where,named", [
    ("pytorch_model.bin", "pytorch_model.bin"), ("critic/pytorch_model.bin", "critic/pytorch_model.bin"),
    ("optimizer/__0_0.distcp.bak", "optimizer/__0_0.distcp.bak"), ("notes/state.pkl", "notes")])
def test_a_file_no_checkpoint_holds_is_refused(copy_of, where, named):
    """Before: resumed, the file left unread (these ones; torch reads a rank's __<r>.metadata)."""
    run_dir = copy_of("ppo.py")
    path = os.path.join(run_dir, STEP2, where)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x80\x02}q\x00.")  # (a pickle of {})
    error = resume("ppo.py", run_dir)
    assert error is not None and error.startswith(f"--resume: {os.path.join(run_dir, STEP2, named)}: no checkpoint "
                                                  "holds such a "), error


def test_metadata_that_torch_would_not_take_is_refused(finished_runs, tmp_path):
    """Only checkpoint classes, but not in a checkpoint's shape: refused by the check itself (the planted test above
    stops earlier, at the stray file)."""
    import dataclasses
    from common.checkpoint import UnsafeCheckpoint, check_dcp_metadata
    with open(os.path.join(finished_runs["grpo.py"], STEP2, "optimizer", ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    key = next(iter(metadata.storage_data))
    elsewhere = {key: dataclasses.replace(metadata.storage_data[key], relative_path="../../model.safetensors")}
    for shape in ({"storage_meta": 1}, {"storage_data": []}, {"storage_data": elsewhere}, {"state_dict_metadata": 3}):
        path = tmp_path / "meta"
        with open(path, "wb") as f:
            pickle.dump(dataclasses.replace(metadata, **shape), f)
        with pytest.raises(UnsafeCheckpoint, match="is not a checkpoint's optimizer metadata"):
            check_dcp_metadata(str(path))


# ---------------------------------------------------------------------------------------------------------------
# ppo.py's critic/ is checked as the policy's part is


@pytest.mark.parametrize("file,how,said", [
    ("model.safetensors", "truncated", "model.safetensors is not a complete safetensors file"),
    ("config.json", "not json", "config.json is damaged: not JSON"),
    ("trainer_state.json", "not json", "trainer_state.json is damaged: not JSON"),
    ("value_head.safetensors", "truncated", "value_head.safetensors is damaged: its value_head"),
    ("value_head.safetensors", "bad header", "value_head.safetensors is damaged: its value_head"),
])
def test_a_damaged_critic_is_a_one_line_error_naming_the_file(copy_of, file, how, said):
    """Before: tracebacks (SafetensorError, JSONDecodeError inside transformers), or, for trainer_state.json, exit 2
    with json's message alone."""
    run_dir = copy_of("ppo.py")
    damage(os.path.join(run_dir, STEP2, "critic", file), how)
    before = files(run_dir)
    error = resume("ppo.py", run_dir)
    assert error is not None and said in error and os.path.join(STEP2, "critic") in error, error
    assert files(run_dir) == before


def test_a_value_head_of_another_shape_is_a_one_line_error_naming_the_file(copy_of):
    """critic/value_head.safetensors, valid but not this critic's head. Before (as JSON): the same one line."""
    run_dir = copy_of("ppo.py")
    path = os.path.join(run_dir, STEP2, "critic", "value_head.safetensors")
    save_file({"weight": torch.zeros(1, 3), "bias": torch.zeros(1)}, path)
    error = resume("ppo.py", run_dir)
    assert error is not None and f"{path} is damaged: its value_head" in error, error


def test_an_older_critic_with_a_json_value_head_resumes_exactly(copy_of, tmp_path):
    """An older ppo.py kept the value head as JSON lists in critic/trainer_state.json: read once, the resume's step
    is the one a resume of the same checkpoint in today's format takes, and its checkpoint has value_head.safetensors."""
    rows, base = {}, copy_of("ppo.py")
    for form in ("safetensors", "json"):
        run_dir = shutil.copytree(base, str(tmp_path / form))
        critic = os.path.join(run_dir, STEP2, "critic")
        if form == "json":
            head = load_file(os.path.join(critic, "value_head.safetensors"))
            os.remove(os.path.join(critic, "value_head.safetensors"))
            edit_json(os.path.join(critic, "trainer_state.json"),
                      lambda s: s.update(value_head={k: v.tolist() for k, v in head.items()}))
        assert resume("ppo.py", run_dir) is None
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows[form] = [{k: v for k, v in r.items() if k.split("/")[0] in ("train", "critic", "policy", "optim")}
                          for r in map(json.loads, f) if r.get("step") == 3 and "train/loss" in r]
        assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000003", "critic", "value_head.safetensors"))
    assert rows["json"] == rows["safetensors"] and len(rows["json"]) == 1


# ---------------------------------------------------------------------------------------------------------------
# Valid JSON of the wrong shape


def edit_json(path, edit):
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("name,file,edit,said", [
    ("grpo.py", "trainer_state.json", lambda s: s["kl_monitor"].pop("baseline"), "its kl_monitor"),
    ("grpo.py", "trainer_state.json", lambda s: s["kl_monitor"].update(recent=5), "its kl_monitor"),
    ("grpo.py", "trainer_state.json", lambda s: s.update(scaler=[1.0]), "its scaler"),
    ("grpo.py", "trainer_state.json", lambda s: s["scaler"].update(scale="high"), "its scaler"),
    ("grpo.py", "rng_rank0.json", lambda s: s["torch"].pop(), "not a random state"),
    ("grpo.py", "rng_rank0.json", lambda s: s["python"][1].pop(), "not a random state"),
    ("ppo.py", "critic/trainer_state.json", lambda s: s["scaler"].pop("good_steps"), "its scaler"),
])
def test_state_of_the_wrong_shape_is_a_one_line_error_naming_the_file(copy_of, name, file, edit, said):
    """Before: tracebacks (KeyError, TypeError from Python's or torch's random state, a size mismatch), or a scale
    that is a string, taken as it was (the traceback came at the first step)."""
    run_dir = copy_of(name)
    path = os.path.join(run_dir, STEP2, file)
    edit_json(path, edit)
    before = files(run_dir)
    error = resume(name, run_dir)
    assert error is not None and f"{path} is damaged: " in error and said in error, error
    assert files(run_dir) == before


# ---------------------------------------------------------------------------------------------------------------
# --num-steps at or below the checkpoint's step


@pytest.mark.parametrize("resume_from,num_steps", [("latest", "2"), ("latest", "1"), (STEP1, "1")])
def test_num_steps_that_leave_nothing_to_train_are_refused(copy_of, resume_from, num_steps):
    """Before: exit 0 having trained nothing, an evaluation row again for the checkpoint's step, and from step 1 the
    checkpoint of step 2 moved aside."""
    run_dir = copy_of("grpo.py")
    before = files(run_dir)
    if resume_from != "latest":
        resume_from = os.path.join(run_dir, resume_from)
    step = "2" if resume_from == "latest" else "1"
    refused("grpo.py", "--run-dir", run_dir, *B, "--num-steps", num_steps, "--resume", resume_from,
            match=f"--num-steps {num_steps}: the checkpoint {run_dir}/checkpoints/step_00000{step} is at step {step} "
                  "already: nothing to train")
    assert files(run_dir) == before

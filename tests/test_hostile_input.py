"""What a hostile input does to a run directory and a resume (docs/faults.md): --overwrite removes nothing until the
new run's inputs are read and checked; a directory holding a model (or anything that is not a run) is never written
into or cleared; a resume that changes what defines the run is refused, what it may change is said and recorded,
config.json is never overwritten; a checkpoint's pickles are checked before torch unpickles them; a damaged file of a
checkpoint or model directory is a one-line error naming it; a resume from an older step keeps the later rows of the
log beside the checkpoints it moves aside. The scripts run on the built-in task, on CPU, mostly in this process
(main() raises the error that their __main__ prints as one line with exit code 2: common/exits.py; a few cases run
them as a user does, to see that line)."""
import dataclasses
import gc
import hashlib
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch

from test_bad_input import SCRIPTS, assert_one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
B = ["--num-prompts", "8", "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0"]
# the scripts whose main() does not yet compare a resume's settings, record them in its checkpoints or keep the log's
# later rows (grpo.py does; the others get the same lines when they are restructured: docs/faults.md)


def run(name, *args):
    return subprocess.run([sys.executable, name, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)


def main(name, *args):
    """The script's main() in this process (a process group of one is already there: the process_group fixture)."""
    gc.collect()  # an earlier main()'s error, caught by a test, holds its frame (and run directory lock) in a cycle
    m = importlib.import_module(name.removesuffix(".py"))
    m.main(m.parse_args(list(args)))


def refused(name, *args, match=None):
    """The one-line error main() raises for bad input (its __main__ exits 2 with it)."""
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        main(name, *args)
    assert "\n" not in str(e.value), str(e.value)
    if match is not None:
        assert match in str(e.value), str(e.value)
    return str(e.value)


def files(path) -> dict:
    """{relative path: sha256} of every file under path but the lock (which each run rewrites)."""
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            if n != ".lock":
                with open(os.path.join(d, n), "rb") as f:
                    out[os.path.relpath(os.path.join(d, n), path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, process_group):
    """A grpo.py run of 2 steps with a checkpoint after each."""
    run_dir = str(tmp_path_factory.mktemp("finished") / "run")
    main("grpo.py", "--run-dir", run_dir, *B, "--num-steps", "2", "--save-every", "1", "--keep-last", "0")
    return run_dir


@pytest.fixture
def old_run(finished_run, tmp_path, process_group):
    """A copy of the finished run, to damage or resume."""
    return shutil.copytree(finished_run, str(tmp_path / "run"))


# ---------------------------------------------------------------------------------------------------------------
# 1. --overwrite removes nothing until every input is read and checked


@pytest.mark.parametrize("name", SCRIPTS)
def test_overwrite_with_a_bad_dataset_leaves_the_old_run_as_it_was(name, old_run, tmp_path):
    """Before: exit 2, and the directory held only .lock (config, metrics and checkpoints gone)."""
    before = files(old_run)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_text": "1+1=", "result": "2"}\n')  # wrong field names
    refused(name, "--run-dir", old_run, *B, "--num-steps", "2", "--overwrite", "--dataset", str(bad),
            match="missing the problem")
    assert files(old_run) == before


def test_overwrite_with_a_model_that_does_not_load_leaves_the_old_run_as_it_was(old_run, tiny_model_dir, tmp_path):
    """A model directory that passes the checks made before the run directory is claimed, then fails to load (a
    model type transformers does not know): the old run is still all there."""
    model = shutil.copytree(tiny_model_dir, str(tmp_path / "m"))
    config = json.load(open(os.path.join(model, "config.json")))
    json.dump({**config, "model_type": "no_such_model_type"}, open(os.path.join(model, "config.json"), "w"))
    before = files(old_run)
    with pytest.raises(ValueError, match="no_such_model_type"):
        main("grpo.py", "--run-dir", old_run, *B, "--num-steps", "2", "--overwrite", "--model", model,
             "--reward", "exact", "--prompt-template", "{problem}")
    assert files(old_run) == before


# ---------------------------------------------------------------------------------------------------------------
# 2. a directory that holds a model, or anything that is not a run, is never cleared


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_model_directory_as_run_directory_is_refused_and_untouched(name, tiny_model_dir, tmp_path, process_group):
    """Before: --overwrite deleted the model's config.json and the run wrote its own in its place."""
    model = shutil.copytree(tiny_model_dir, str(tmp_path / "m"))
    before = files(model)
    refused(name, "--run-dir", model, *B, "--num-steps", "1", "--overwrite",
            match="holds a model (config.json of a Hugging Face model")
    refused(name, "--run-dir", model, *B, "--num-steps", "1", match="holds a model")
    assert files(model) == before


def test_a_model_directory_as_run_directory_exits_2_before_a_model_loads(tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, str(tmp_path / "m"))
    before = files(model)
    p = run("grpo.py", "--run-dir", model, *B, "--num-steps", "1", "--overwrite")
    assert_one_line_error(p, 2, f"--run-dir {model!r}: it holds a model (config.json of a Hugging Face model, "
                                "model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json)")
    assert "Loading weights" not in p.stderr
    assert files(model) == before


def test_what_is_not_a_run(tmp_path, tiny_model_dir):
    from common.rundir import not_a_run
    assert not_a_run(str(tmp_path)) is None  # empty
    assert "holds a model" in not_a_run(tiny_model_dir)
    (tmp_path / "config.json").write_text(json.dumps({"script": "grpo.py", "seed": 1}))
    assert not_a_run(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"exp_name": "grpo", "seed": 1, "num_steps": 5}))
    assert not_a_run(str(tmp_path)) is None  # a run of a version that did not record the script
    (tmp_path / "config.json").write_text(json.dumps({"learning_rate": 1}))  # another tool's
    assert "not a run's" in not_a_run(str(tmp_path))
    (tmp_path / "config.json").write_text("{ not json")
    assert "not a run's" in not_a_run(str(tmp_path))
    (tmp_path / "config.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "holds a model (model.safetensors)" in not_a_run(str(tmp_path))


def foreign_checkpoints_and_wandb(path, tiny_model_dir):
    """A directory of another tool: a Hugging Face model in its checkpoints/, and its own wandb/."""
    shutil.copytree(tiny_model_dir, str(path / "checkpoints"))
    os.makedirs(path / "wandb" / "run-20261126_101010-abc")
    (path / "wandb" / "run-20261126_101010-abc" / "run-abc.wandb").write_bytes(b"not ours")
    return str(path)


def test_what_is_a_run_of_this_project(tmp_path, tiny_model_dir):
    """A run's files are recognised by what the scripts write; files named like a run's but not written by one make
    the directory not a run's. Before, any checkpoints/, wandb/ or metrics.jsonl was "another run", and --overwrite
    deleted it."""
    from common.rundir import not_a_run
    other = foreign_checkpoints_and_wandb(tmp_path / "other", tiny_model_dir)
    assert "its checkpoints/ is not a run's checkpoints (it holds config.json, generation_config.json" in \
        not_a_run(other)
    shutil.rmtree(os.path.join(other, "checkpoints"))
    assert "its wandb/ is not a run's" in not_a_run(other)
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')  # another tool's log
    assert not_a_run(str(lone)) == "its metrics.jsonl is not a run's (no run's config.json beside it)"
    run = tmp_path / "run"
    os.makedirs(run / "checkpoints" / "step_000002")
    os.makedirs(run / "checkpoints" / "step_000003.tmp")
    os.makedirs(run / "checkpoints" / "abandoned_20261127-101010_2")
    (run / "config.json").write_text(json.dumps({"script": "grpo.py", "seed": 1, "track": False}))
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    assert not_a_run(str(run)) is None
    os.makedirs(run / "wandb")  # logged to W&B only since a resume (--track), which its record says
    assert "its wandb/ is not a run's" in not_a_run(str(run))
    (run / "config_resume_000002.json").write_text(json.dumps({"script": "grpo.py", "seed": 1, "track": True}))
    assert not_a_run(str(run)) is None
    (run / "checkpoints" / "notes.txt").write_text("mine")
    assert "(it holds notes.txt, not step_NNNNNN folders)" in not_a_run(str(run))


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_directory_with_another_tools_checkpoints_and_wandb_is_refused_and_untouched(overwrite, tmp_path,
                                                                                       tiny_model_dir, process_group):
    """Before: called "another run" (--resume latest suggested), and --overwrite deleted its checkpoints/ (a model)
    and wandb/."""
    other = foreign_checkpoints_and_wandb(tmp_path / "other", tiny_model_dir)
    before = files(other)
    refused("grpo.py", "--run-dir", other, *B, "--num-steps", "1", *(["--overwrite"] if overwrite else []),
            match="its checkpoints/ is not a run's checkpoints")
    assert files(other) == before


def test_a_lone_metrics_log_of_another_tool_is_refused_and_untouched(tmp_path, process_group):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    refused("grpo.py", "--run-dir", str(tmp_path), *B, "--num-steps", "1", "--overwrite",
            match="its metrics.jsonl is not a run's (no run's config.json beside it)")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'


def test_overwrite_removes_a_runs_files_and_only_them(tmp_path):
    from common.rundir import LOCK_FILE, claim_run_dir, clear_run_dir
    run = tmp_path / "run"
    os.makedirs(run / "checkpoints" / "step_000002")
    os.makedirs(run / "checkpoints" / "abandoned_20261127-101010")
    os.makedirs(run / "wandb" / "run-1")
    (run / "config.json").write_text(json.dumps({"script": "ppo.py", "seed": 1, "track": True}))
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    (run / "train.log").write_text("a log teed here\n")
    lock = claim_run_dir(str(run), None, overwrite=True)
    clear_run_dir(str(run))
    lock.release()
    assert sorted(os.listdir(run)) == [LOCK_FILE, "train.log"]


def test_reward_model_overwrite_replaces_only_a_reward_model_it_wrote(tmp_path, tiny_model_dir):
    """Before: `python -m tasks.reward_model --out-dir X --overwrite` deleted X whatever it was: an RL run's
    directory, or the reward model given as --base (it replaced its own base)."""
    from tasks.reward_model import Args, main as train_rm
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    run = tmp_path / "run"  # an RL run's directory
    os.makedirs(run / "checkpoints" / "step_000001")
    (run / "config.json").write_text(json.dumps({"script": "grpo.py", "seed": 1}))
    rm = shutil.copytree(tiny_model_dir, str(tmp_path / "rm"))  # a reward model this tool wrote
    (tmp_path / "rm" / "reward_model.json").write_text(json.dumps({"format": "raw", "base": tiny_model_dir}))
    for out_dir, base, said in [(str(run), tiny_model_dir, "is not a reward model this tool wrote"),
                                (tiny_model_dir, tiny_model_dir, "is not a reward model this tool wrote"),
                                (rm, rm, f"holds --base {rm!r}, which this training reads")]:
        before = files(out_dir)
        with pytest.raises(ValueError, match=re.escape(said)):
            train_rm(Args(base=base, pairs=str(pairs), out_dir=out_dir, overwrite=True))
        assert files(out_dir) == before


def test_resume_latest_of_a_directory_that_does_not_exist_does_not_make_it(tmp_path, process_group):
    """Before: the directory was made (with its lock file) before the resume found no checkpoint in it."""
    refused("grpo.py", "--run-dir", str(tmp_path / "typo"), *B, "--num-steps", "1", "--resume", "latest",
            match=f"--resume latest: --run-dir {str(tmp_path / 'typo')!r} does not exist")
    assert not os.path.exists(tmp_path / "typo")


def test_an_empty_run_dir_is_refused():
    """Before: --run-dir '' silently meant the default, runs/<exp_name>_<seed>."""
    import grpo
    with pytest.raises(ValueError, match="--run-dir '': an empty path"):
        grpo.validate(grpo.parse_args(["--run-dir", ""]), 1)


# ---------------------------------------------------------------------------------------------------------------
# 3. a resume with other settings


@pytest.mark.parametrize("flags,named", [
    (["--group-size", "2"], "group_size 4 -> 2"), (["--seed", "2"], "seed 1 -> 2"),
    (["--precision", "bf16"], "precision fp32 -> bf16"), (["--max-response-len", "6"], "max_response_len 8 -> 6"),
    (["--is-correction", "token-tis"], "is_correction none -> token-tis")])
def test_resume_refuses_a_change_to_what_defines_the_run(old_run, flags, named):
    """Before: exit 0, nothing said, and config.json overwritten with the new values."""
    before = files(old_run)
    error = refused("grpo.py", "--run-dir", old_run, *B, "--num-steps", "3", "--resume", "latest", *flags)
    assert error.startswith("--resume: settings that define the run differ from those the checkpoint was trained "
                            f"with ({old_run}/checkpoints/step_000002/trainer_state.json): {named}; "), error
    assert "--accept-changes" in error
    assert files(old_run) == before


def test_resume_by_another_script_is_refused(old_run):
    """The checkpoint's settings name the script that wrote it (here as gspo.py would, once it records them)."""
    state_path = os.path.join(old_run, "checkpoints", "step_000002", "trainer_state.json")
    state = json.load(open(state_path))
    assert state["config"]["script"] == "grpo.py"
    state["config"]["script"] = "gspo.py"
    json.dump(state, open(state_path, "w"))
    refused("grpo.py", "--run-dir", old_run, *B, "--num-steps", "3", "--resume", "latest",
            match="script gspo.py -> grpo.py")


@pytest.mark.parametrize("name", ["gspo.py"])
def test_another_script_refuses_a_grpo_run(old_run, name):
    refused(name, "--run-dir", old_run, *B, "--num-steps", "3", "--resume", "latest", match=f"script grpo.py -> {name}")


def test_resume_says_and_records_what_it_may_change_and_keeps_config_json(old_run, capsys):
    config = open(os.path.join(old_run, "config.json")).read()
    main("grpo.py", "--run-dir", old_run, *B, "--num-steps", "3", "--resume", "latest", "--lr", "1e-4",
         "--save-every", "0")
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("[resume] changed since")]
    assert len(said) == 1 and f"({old_run}/checkpoints/step_000002/trainer_state.json): " in said[0], out
    for change in ("lr 0.0005 -> 0.0001", "num_steps 2 -> 3", "save_every 1 -> 0", "keep_last 0 -> 3",
                   f"-> {old_run}"):  # (the run directory is a copy of the run's: moved)
        assert change in said[0], said
    assert open(os.path.join(old_run, "config.json")).read() == config  # the run's first settings
    record = json.load(open(os.path.join(old_run, "config_resume_000002.json")))
    assert (record["lr"], record["num_steps"], record["resume"], record["script"]) == (1e-4, 3, "latest", "grpo.py")
    state = json.load(open(os.path.join(old_run, "checkpoints", "step_000003", "trainer_state.json")))
    assert state["config"] == record  # what the next resume compares with


def test_accept_changes_continues_on_purpose_and_the_change_sticks(old_run, capsys):
    main("grpo.py", "--run-dir", old_run, *B, "--num-steps", "3", "--resume", "latest", "--group-size", "2",
         "--accept-changes")
    assert "[resume] --accept-changes: continuing with settings that define the run changed: group_size 4 -> 2" in \
        capsys.readouterr().out
    assert json.load(open(os.path.join(old_run, "config.json")))["group_size"] == 4
    assert json.load(open(os.path.join(old_run, "config_resume_000002.json")))["group_size"] == 2
    # the checkpoint of step 3 was trained with group size 2: resuming it with 2 needs no flag, with 4 does
    refused("grpo.py", "--run-dir", old_run, *B, "--num-steps", "4", "--resume", "latest",
            match="group_size 2 -> 4")
    main("grpo.py", "--run-dir", old_run, *B, "--num-steps", "4", "--resume", "latest", "--group-size", "2")
    assert json.load(open(os.path.join(old_run, "config_resume_000003.json")))["group_size"] == 2


def test_resume_with_another_lr_trains_at_it_and_saves_it(finished_run, tmp_path):
    """Before: the optimizer state loaded from the checkpoint brought the checkpoint's lr back, so a resume with --lr
    was said and logged but trained at the old rate (every number bit-identical to a resume without the flag) and the
    next checkpoint saved the old rate. Step 3 from the same state and batch: AdamW's step (the moments' direction
    plus the decay) is proportional to the lr, so ten times the lr moves the weights ten times as far."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    before = load_file(os.path.join(finished_run, "checkpoints", "step_000002", "model.safetensors"))
    moved, saved = {}, {}
    for lr in (5e-4, 5e-3):  # the run's own lr (5e-4, the built-in preset's), then ten times it
        run_dir = shutil.copytree(finished_run, str(tmp_path / f"lr{lr:g}"))
        main("grpo.py", "--run-dir", run_dir, *B, "--num-steps", "3", "--resume", "latest", "--lr", str(lr))
        ckpt = os.path.join(run_dir, "checkpoints", "step_000003")
        after = load_file(os.path.join(ckpt, "model.safetensors"))
        moved[lr] = torch.cat([(after[k] - before[k]).flatten() for k in before]).norm().item()
        dcp_to_torch_save(os.path.join(ckpt, "optimizer"), str(tmp_path / "optimizer.pt"))
        groups = torch.load(str(tmp_path / "optimizer.pt"), weights_only=True)["optimizer"]["param_groups"]
        saved[lr] = {group["lr"] for group in groups}
    assert 9 < moved[5e-3] / moved[5e-4] < 11, moved
    assert saved == {5e-4: {5e-4}, 5e-3: {5e-3}}  # what the next resume starts from


def test_a_loaded_optimizer_state_keeps_this_runs_settings(tmp_path, tiny_model_dir, process_group):
    """What the resume of every part does (ppo.py's critic and its --critic-lr too, common/checkpoint.py): the
    checkpoint's AdamW moments and step counts, this run's lr, betas and weight decay."""
    from transformers import AutoTokenizer
    from common.checkpoint import load_training_state, rng_state, save_checkpoint
    from common.fsdp import load_policy
    _, _, device = process_group
    model = load_policy(tiny_model_dir, torch.float32, device, gradient_checkpointing=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    ckpt = save_checkpoint(str(tmp_path / "checkpoints"), 1, AutoTokenizer.from_pretrained(tiny_model_dir),
                           {"": (model, optimizer, {})}, rng_state())
    saved = [s["exp_avg"].full_tensor().clone() for s in optimizer.state.values()]
    model.zero_grad(set_to_none=True)  # (as in a resumed run's fresh model)
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.8, 0.9), weight_decay=0.1)
    load_training_state(ckpt, model, resumed)
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in resumed.param_groups] == [(1e-4, (0.8, 0.9), 0.1)]
    assert all(torch.equal(s["exp_avg"].full_tensor(), m) for s, m in zip(resumed.state.values(), saved, strict=True))


def test_accept_changes_goes_with_resume():
    import grpo
    with pytest.raises(ValueError, match="--accept-changes .* goes with --resume"):
        grpo.validate(grpo.parse_args(["--accept-changes"]), 1)


def test_resume_of_a_checkpoint_that_did_not_record_its_settings(tmp_path, capsys):
    """A checkpoint of a version before the settings went into trainer_state.json (2026-11-26): resumed without the
    comparison, said in one line."""
    from common.config import check_resume_config
    os.makedirs(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "trainer_state.json").write_text(json.dumps({"step": 3}))
    now = {"exp_name": "grpo", "seed": 1, "num_steps": 20, "group_size": 4, "script": "grpo.py"}
    assert check_resume_config(str(tmp_path / "elsewhere"), str(tmp_path / "empty"), now, False) == {}
    assert "not compared" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# 4. a checkpoint's pickles run no code


class RunsCode:
    """A pickle that, when loaded, creates the directory `marker`: what a shared checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_resume_does_not_unpickle_a_planted_optimizer_metadata(old_run, tmp_path):
    """Before: torch's checkpoint reader unpickled optimizer/.metadata without restriction, and the marker appeared."""
    marker = tmp_path / "pwned"
    metadata = os.path.join(old_run, "checkpoints", "step_000002", "optimizer", ".metadata")
    with open(metadata, "wb") as f:
        pickle.dump(RunsCode(str(marker)), f)
    p = run("grpo.py", "--run-dir", old_run, *B, "--num-steps", "3", "--resume", "latest")
    assert not marker.exists()
    assert_one_line_error(p, 2, f"--resume: {metadata} is not a checkpoint's optimizer metadata (UnpicklingError: it "
                                "names os.makedirs, which is no part of checkpoint metadata); refused")


def test_resume_does_not_unpickle_a_planted_optimizer_value(old_run, tmp_path, process_group):
    """The optimizer's non-tensor values (lr, betas, ...) are torch.save pickles inside the .distcp shard, which DCP's
    default planner loads with weights_only=False. Here the metadata (only checkpoint classes: it passes its check)
    points the lr at a pickle appended to the shard: before, loading it created the marker."""
    from common.checkpoint import load_training_state
    from common.fsdp import load_policy
    _, _, device = process_group
    marker, ckpt = tmp_path / "pwned", os.path.join(old_run, "checkpoints", "step_000002")
    metadata_path = os.path.join(ckpt, "optimizer", ".metadata")
    with open(metadata_path, "rb") as f:
        metadata = pickle.load(f)  # (written by the run above: ours)
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[key]
    shard = os.path.join(ckpt, "optimizer", info.relative_path)
    payload = pickle.dumps(RunsCode(str(marker)), protocol=2)  # (as torch.save writes)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(payload)
    metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(payload))
    with open(metadata_path, "wb") as f:
        pickle.dump(metadata, f)
    model = load_policy(ckpt, torch.float32, device, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(BaseException) as e:
        load_training_state(ckpt, model, optimizer)
    assert not marker.exists()
    from common.checkpoint import UnsafeCheckpoint
    assert isinstance(e.value, UnsafeCheckpoint) and "\n" not in str(e.value), str(e.value)
    assert f"{ckpt}/optimizer: its value optimizer.param_groups.0.lr is not plain data" in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# 5, 8. damaged files: one line, naming the file


def damage(path, how):
    if how == "not json":
        with open(path, "w") as f:
            f.write('{"step": 2, "scal')
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "bad header":  # a well-formed header whose offsets do not tile the data
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            data = f.read()
        first = next(k for k in header if k != "__metadata__")
        header[first]["dtype"] = "XX"
        text = json.dumps(header).encode()
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("file,how,said", [
    ("model.safetensors", "truncated", "model.safetensors is not a complete safetensors file"),
    ("model.safetensors", "bad header", "model.safetensors is not a complete safetensors file"),
    ("config.json", "not json", "config.json is damaged: not JSON"),
    ("tokenizer_config.json", "not json", "tokenizer_config.json is damaged: not JSON"),
    ("trainer_state.json", "not json", "trainer_state.json is damaged: not JSON"),
    ("rng_rank0.json", "not json", "rng_rank0.json is damaged: not JSON"),
])
def test_a_damaged_checkpoint_is_a_one_line_error_naming_the_file(old_run, file, how, said):
    """Before: tracebacks (SafetensorError: the resume directory's weights never got the check --model's get; the
    tokenizer's JSONDecodeError) or a JSON error without the file's name."""
    damage(os.path.join(old_run, "checkpoints", "step_000002", file), how)
    error = refused("grpo.py", "--run-dir", old_run, *B, "--num-steps", "3", "--resume", "latest", match=said)
    assert "checkpoints/step_000002" in error


def test_a_model_whose_config_is_not_json_is_named(tiny_model_dir, tmp_path):
    from common.preflight import check_model_dir
    model = shutil.copytree(tiny_model_dir, str(tmp_path / "m"))
    damage(os.path.join(model, "config.json"), "not json")
    with pytest.raises(ValueError, match=f"--model '{model}': config.json is damaged: not JSON"):
        check_model_dir(model)  # (in validate, before the run directory is claimed)


def test_a_dataset_that_is_not_utf8_is_named(tmp_path):
    from tasks.data import load_problems
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"problem": "1+1=", "answer": "2"}\n{"problem": "caf\xe9", "answer": "3"}\n')
    with pytest.raises(ValueError, match=f"{path}: line 2: not UTF-8 text \\(byte 0xe9 at column 17\\)"):
        load_problems(str(path))
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[{"problem": "caf\xe9", "answer": "3"}]')
    with pytest.raises(ValueError, match=f"{path}: not UTF-8 text"):
        load_problems(str(path))


# ---------------------------------------------------------------------------------------------------------------
# 8. resuming from an older step keeps the later rows of the log beside the checkpoints it moves aside


def test_resume_from_an_older_step_keeps_the_later_rows_beside_the_later_checkpoints(old_run):
    rows = [json.loads(line) for line in open(os.path.join(old_run, "metrics.jsonl"))]
    later = [r for r in rows if r["step"] > 1]
    assert later  # step 2's training row and its final evaluation
    main("grpo.py", "--run-dir", old_run, *B, "--num-steps", "2", "--save-every", "1", "--resume",
         os.path.join(old_run, "checkpoints", "step_000001"))
    aside = [d for d in os.listdir(os.path.join(old_run, "checkpoints")) if d.startswith("abandoned_")]
    assert len(aside) == 1
    kept = os.path.join(old_run, "checkpoints", aside[0])
    assert sorted(os.listdir(kept)) == ["metrics.jsonl", "step_000002"]
    assert [json.loads(line) for line in open(os.path.join(kept, "metrics.jsonl"))] == later
    assert [r["step"] for r in map(json.loads, open(os.path.join(old_run, "metrics.jsonl")))
            if "train/accuracy" in r] == [1, 2]  # the log of the line resumed

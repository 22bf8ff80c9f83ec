"""A run's settings: the line said at start (config_changes), their record (run_config), what a resume may change."""
import dataclasses
import json
import os

from common.checkpoint import read_json
from common.dist import print0

# The settings a resume may change without --accept-changes (docs/faults.md, "Resuming with other settings"); every
# other one defines what the run computes (model, data, seed, precision, ...): another value makes a different run.
RESUME_MAY_CHANGE = frozenset({
    "num_steps", "eval_every", "save_every", "keep_last",
    "eval_dataset", "eval_k", "eval_temperature", "eval_top_p", "eval_max_problems",
    "exp_name", "run_dir", "track", "wandb_project",
    "sampler", "sampler_batch_size", "vllm_tp", "vllm_gpu_memory_utilization", "vllm_kv_cache_gib",
    "vllm_sleep_level", "micro_batch_tokens", "logprob_chunk", "gradient_checkpointing", "cpu_offload", "compile",
    "max_skipped_steps", "kl_warn_factor", "rm_batch_tokens",
    "lr", "critic_lr",
    "resume", "overwrite", "accept_changes",
})


def flat_fields(obj) -> dict:
    """A dataclass instance's fields as one flat dict; a nested dataclass field (a group of flags) is flattened."""
    out = {}
    for key, value in (obj if isinstance(obj, dict) else dataclasses.asdict(obj)).items():
        out.update(flat_fields(value) if isinstance(value, dict) else {key: value})
    return out


def _show(value) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(_show(v) for v in value) or "()"
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_changes(args, defaults, preset: dict, preset_name: str) -> str:
    """One line: the fields of `args` that differ from `defaults`, said as the preset's or the command line's."""
    base = flat_fields(defaults)
    changed = {k: v for k, v in flat_fields(args).items() if v != base[k]}
    from_preset = [f"{k} {_show(v)}" for k, v in changed.items() if k in preset and v == preset[k]]
    from_cli = [f"{k} {_show(v)}" for k, v in changed.items() if not (k in preset and v == preset[k])]
    parts = ([f"{preset_name}: {', '.join(from_preset)}"] if from_preset else []) + \
        ([f"command line: {', '.join(from_cli)}"] if from_cli else [])
    return "[config] Args' defaults" + (", except: " + "; ".join(parts) if parts else "")


def run_config(script_file: str, args) -> dict:
    """What config.json records of a run: the script's file name and every field of its Args, as JSON values."""
    config = {"script": os.path.basename(script_file), **flat_fields(args)}
    return json.loads(json.dumps(config, default=str))  # tuples as lists: as the file reads back


def check_resume_config(resume_dir: str, run_dir: str, config: dict, accept_changes: bool) -> dict[str, tuple]:
    """Compare a resume's settings with the checkpoint's before anything loads: a change to one that defines the run
    is refused unless accept_changes; every change is said. Returns {field: (recorded, now)}. (run_dir: not read.)"""
    source = os.path.join(resume_dir, "trainer_state.json")
    recorded = read_json(source, "--resume").get("config")
    if not isinstance(recorded, dict):
        print0(f"[resume] {source} holds no record of the settings it was trained with (a checkpoint of a version "
               "before 2026-11-26): they are not compared with this run's")
        return {}
    # a field the record lacks is new in the code: not compared; one only the record has (another script's): a change
    changes = {k: (v, config.get(k, "(absent)")) for k, v in sorted(recorded.items()) if v != config.get(k, "(absent)")}

    def said(keys) -> str:
        return ", ".join(f"{k} {_show(changes[k][0])} -> {_show(changes[k][1])}" for k in keys)
    defining = [k for k in changes if k not in RESUME_MAY_CHANGE]
    if defining and not accept_changes:
        raise ValueError(f"--resume: settings that define the run differ from those the checkpoint was trained with "
                         f"({source}): {said(defining)}; resume with the run's values, or add --accept-changes to "
                         "continue with these on purpose (each change is recorded in the run directory)")
    allowed = said(k for k in changes if k in RESUME_MAY_CHANGE and k not in ("resume", "overwrite", "accept_changes"))
    if allowed:
        print0(f"[resume] changed since the checkpoint's settings ({source}): {allowed}")
    if defining:
        print0(f"[resume] --accept-changes: continuing with settings that define the run changed: {said(defining)}")
    return changes

"""What a run uses, said at start: every value that differs from the script's Args defaults, and where it came from.

The scripts keep the study's defaults in Args and the built-in task's in a BUILTIN dict beside it, applied (under the
command line) when no --model is given; parse_args in each script shows that rule, this module only reports it."""
import dataclasses


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
    """One line: the fields of `args` that differ from `defaults` (dataclass instances of the same class), those
    equal to `preset`'s value marked as the preset's, the others as the command line's."""
    now, base = flat_fields(args), flat_fields(defaults)
    changed = {k: v for k, v in now.items() if v != base[k]}
    from_preset = [f"{k} {_show(v)}" for k, v in changed.items() if k in preset and v == preset[k]]
    from_cli = [f"{k} {_show(v)}" for k, v in changed.items() if not (k in preset and v == preset[k])]
    parts = ([f"{preset_name}: {', '.join(from_preset)}"] if from_preset else []) + \
        ([f"command line: {', '.join(from_cli)}"] if from_cli else [])
    return "[config] Args' defaults" + (", except: " + "; ".join(parts) if parts else "")

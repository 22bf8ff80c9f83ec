"""The algorithm scripts of a checkout, for the tools that run every script (the tests, sanity/run_sanity.py
--algorithms): read from the tree (no script is imported), so that a fork of grpo.py under a new name is in all."""
import ast
import os


def algorithm_scripts(root: str) -> list[str]:
    """The .py files at the top of `root` defining main() and parse_args() at their top level, sorted by name."""
    def defines(name: str) -> set[str]:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            return {node.name for node in ast.parse(f.read(), filename=name).body if isinstance(node, ast.FunctionDef)}
    return [name for name in sorted(os.listdir(root)) if name.endswith(".py")
            and os.path.isfile(os.path.join(root, name)) and {"main", "parse_args"} <= defines(name)]

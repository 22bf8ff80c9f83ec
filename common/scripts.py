"""The algorithm scripts of a checkout, found by reading the tree: the tools that run every script (the tests,
sanity/run_sanity.py --algorithms) take the list from here, so that a fork (a copy of grpo.py under a new name) is
in all of them without being named anywhere. The files' syntax is read; no script is imported."""
import ast
import os


def algorithm_scripts(root: str) -> list[str]:
    """The .py files at the top of `root` that define both main() and parse_args() at their top level, sorted by
    name (e.g. ["cispo.py", "grpo.py", ...]); a module of helpers or a tool under sanity/ is not one."""
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not (name.endswith(".py") and os.path.isfile(path)):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=name)
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        if {"main", "parse_args"} <= defined:
            found.append(name)
    return found

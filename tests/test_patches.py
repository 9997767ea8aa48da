"""Every `workflow.patched` / `workflow.deprecate_patch` id in the source is registered in
`llmgw.workflows.patches` (with the version that added it and when it may go), and every registered id is
still asked by the code, as the registry says (`patched`, or `deprecated`; per pass or not). Read from the
source with `ast`: a patch added anywhere under src/llmgw is found, whatever module asks it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from llmgw.version import minor
from llmgw.workflows.patches import PATCHES
from tests.helpers import parse_source

SRC = Path(__file__).resolve().parent.parent / "src"
CALLS = {"patched": "patched", "deprecate_patch": "deprecated"}


def _module(path: Path):
    return importlib.import_module(".".join(path.relative_to(SRC).with_suffix("").parts))


def _id(arg: ast.expr, path: Path) -> tuple[str, bool]:
    """(the id, whether it is per pass: an f-string `f"{ID}/{pass_no}"`)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value, False
    if isinstance(arg, ast.Name):
        return getattr(_module(path), arg.id), False
    if isinstance(arg, ast.JoinedStr) and len(arg.values) in (2, 3):  # f"{ID}/{pass_no}", f"{ID}/0"
        head, sep = arg.values[:2]
        if (isinstance(head, ast.FormattedValue) and isinstance(head.value, ast.Name)
                and isinstance(sep, ast.Constant) and str(sep.value).startswith("/")):
            return getattr(_module(path), head.value.id), True
    raise AssertionError(f"{path}:{arg.lineno}: a patch id must be a registered constant (or f\"{{ID}}/{{pass}}\")")


def asked() -> dict[str, set[tuple[str, bool, str]]]:
    """id -> {(how it is asked: patched/deprecated, per pass, where)}, from every module under src/llmgw."""
    found: dict[str, set[tuple[str, bool, str]]] = {}
    for path in sorted((SRC / "llmgw").rglob("*.py")):
        for node in ast.walk(parse_source(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CALLS
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "workflow"):
                pid, per_pass = _id(node.args[0], path)
                found.setdefault(pid, set()).add((CALLS[node.func.attr], per_pass, f"{path.name}:{node.lineno}"))
    return found


def test_every_asked_patch_is_registered_and_every_registered_one_is_asked():
    found = asked()
    assert len(found) >= 9  # the scan sees the patches that exist (10 before issue 38 retired `rollout`)
    unregistered = sorted(set(found) - set(PATCHES))
    assert not unregistered, f"patch ids asked but not registered in workflows/patches.py: {unregistered}"
    unused = sorted(set(PATCHES) - set(found))
    assert not unused, (f"registered patch ids no workflow asks any more: {unused}; a removed patch leaves "
                        "the registry with its last call")


def test_each_patch_is_asked_as_registered():
    for pid, uses in asked().items():
        p = PATCHES[pid]
        assert {(state, per_pass) for state, per_pass, _ in uses} == {(p.state, p.per_pass)}, (pid, uses)


def test_registry_entries_are_complete():
    for p in PATCHES.values():
        assert minor(p.added_in), p
        assert p.workflow and p.retire and p.why, p

"""The house rules, read from the imports (ast): folders follow processes (docs/architecture.md, "Folders").

- A process folder (`gateway/`, `control/`, `node/`, `mirror/`, `ctl/`) never imports another process
  folder; only the composition roots (`cli.py`, `server.py`, `dev/`) put processes together.
- A shared layer never imports a process folder or a composition root.
- `workflows/` imports only `schemas`, `placement`, itself and the pure URL and cache-name functions of
  `weights` (`urls`, `naming`), so workflow code has nothing to do I/O with.
- `placement/` imports no database, no network client: `schemas`, `catalog`, `spelling` and `weights.naming`.
- Node code never imports `db/`: a node knows the fleet only through the node API and its activities.
- No cycle between folders (or top-level modules).

Every `import` counts, lazy ones inside functions and `TYPE_CHECKING` ones included: a lazy import is
still a dependency, only a later one.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest
from tests.helpers import parse_source

ROOT = Path(__file__).resolve().parent.parent / "src" / "llmgw"
PROCESSES = {"gateway", "control", "node", "mirror", "ctl"}
ROOTS = {"cli", "server", "dev", "__main__"}
ALLOWED_ONLY = {  # unit -> the only llmgw modules (prefixes) it may import besides its own
    "workflows": ("schemas", "placement", "weights.urls", "weights.naming"),
    "placement": ("schemas", "catalog", "spelling", "weights.naming"),
}


def units() -> set[str]:
    """Folders and top-level modules of the package: the units the rules speak of."""
    return {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}


def scan(files: list[tuple[str, str]]) -> list[tuple[str, str, str, int]]:
    """(importing unit, imported dotted module without `llmgw.`, file, line) for every llmgw import in
    `files`: (path relative to the package, source) pairs."""
    known = units()
    found = []
    for rel, source in files:
        unit = rel.split("/")[0].removesuffix(".py")
        for node in ast.walk(parse_source(source, rel)):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "llmgw":
                    names = [a.name for a in node.names]
                elif node.module.startswith("llmgw."):
                    base = node.module.removeprefix("llmgw.")
                    names = [f"{base}.{a.name}" for a in node.names]  # `from llmgw.x import y`: y may be a module
            elif isinstance(node, ast.Import):
                names = [a.name.removeprefix("llmgw.") for a in node.names if a.name.startswith("llmgw.")]
            for name in names:
                if name.split(".")[0] in known and name.split(".")[0] != unit:
                    found.append((unit, name, rel, node.lineno))
    return found


@functools.cache
def imports() -> list[tuple[str, str, str, int]]:
    """`scan` of the whole package."""
    return scan([(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(ROOT.rglob("*.py"))])


def violations(found: list[tuple[str, str, str, int]]) -> list[str]:
    """Each broken rule as `file:line: unit imports X (the rule)`."""
    bad = []
    for unit, name, rel, line in found:
        target = name.split(".")[0]
        why = None
        if unit in ALLOWED_ONLY and not any(name == p or name.startswith(p + ".") for p in ALLOWED_ONLY[unit]):
            why = f"{unit}/ imports only {', '.join(ALLOWED_ONLY[unit])}"
        elif unit in PROCESSES and target in PROCESSES:
            why = "a process folder never imports another process folder"
        elif unit not in PROCESSES | ROOTS and target in PROCESSES | ROOTS:
            why = "a shared layer never imports a process folder or a composition root"
        elif unit == "node" and target == "db":
            why = "node code never imports db/ (it reaches the fleet through the node API and its activities)"
        if why:
            bad.append(f"{rel}:{line}: {unit} imports llmgw.{name} ({why})")
    return bad


def cycles(found: list[tuple[str, str, str, int]]) -> list[list[str]]:
    """Folder-level cycles (strongly connected components of more than one unit)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for unit, name, _, _ in found:
        graph[unit].add(name.split(".")[0])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_the_folders_follow_the_import_rules():
    bad = violations(imports())
    assert not bad, "imports that break the house rules:\n" + "\n".join(bad)


def test_no_cycle_between_folders():
    assert not cycles(imports()), f"folder-level import cycles: {cycles(imports())}"


def test_the_old_framework_folders_are_gone():
    assert not (ROOT / "activities").exists() and not (ROOT / "workers").exists()


@pytest.mark.parametrize("where, line, rule", [
    ("gateway/x.py", "from llmgw.control.admin import create_admin_app", "process folder"),
    ("node/x.py", "from llmgw.db import fleet_repo", "never imports db/"),
    ("workflows/x.py", "from llmgw.db.engine import make_engine", "workflows/ imports only"),
    ("workflows/x.py", "from llmgw import weights", "workflows/ imports only"),
    ("placement/x.py", "import llmgw.temporal", "placement/ imports only"),
    ("schemas/x.py", "from llmgw.gateway.proxy import Proxy", "shared layer"),
    ("http/x.py", "def f():\n    from llmgw.node.agent import Agent", "shared layer"),
])
def test_a_forbidden_import_is_caught(where, line, rule):
    """The checker itself: the package with one forbidden import added fails, naming the rule."""
    bad = violations(imports() + scan([(where, line + "\n")]))
    assert any(b.startswith(where) and rule in b for b in bad), bad


def test_a_cycle_is_caught():
    """schemas -> db -> schemas is a cycle even though each import alone could look harmless."""
    assert any({"schemas", "db"} <= set(c) for c in cycles(imports() + scan([("schemas/x.py", "from llmgw.db import tables\n")])))

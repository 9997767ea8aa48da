"""YAML → `Catalog`, with every rule that can be checked before anything runs.

Errors name the field the way an operator wrote it (`models[1] (smollm2-135m).scaling.max`) and say what
to write instead. A catalog that fails any rule is refused whole: nothing is applied half-way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from llmgw.catalog.policy import PolicyError, check_profile
from llmgw.schemas.catalog import Catalog


class CatalogError(ValueError):
    """The catalog cannot be applied. `problems` lists one line per problem, each naming its field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("catalog refused:\n" + "\n".join(f"  - {p}" for p in problems))


def _loc(loc: tuple[Any, ...], raw: Any) -> str:
    out = ""
    node = raw
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            name = node[part].get("name") if isinstance(node, list) and part < len(node) and isinstance(node[part], dict) else None
            if name:
                out += f" ({name})"
            node = node[part] if isinstance(node, list) and part < len(node) else None
        else:
            out += ("." if out else "") + str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out


def parse_catalog(raw: Any) -> Catalog:
    """Validate a decoded YAML/JSON document. Raises `CatalogError` naming each bad field."""
    if raw is None:
        raw = {"models": []}
    if isinstance(raw, list):
        raw = {"models": raw}
    if not isinstance(raw, dict):
        raise CatalogError(["the catalog must be a mapping with a `models:` list"])
    try:
        catalog = Catalog.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = _loc(tuple(err["loc"]), raw) or "catalog"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field; check its spelling against docs/catalog.md"
            problems.append(f"{where}: {msg}")
        raise CatalogError(problems) from None
    check_catalog(catalog)
    return catalog


def check_catalog(catalog: Catalog) -> None:
    """Cross-model rules: unique names and aliases, fallbacks and guards that exist, engine policy per profile."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for i, m in enumerate(catalog.models):
        for n in [m.name, *m.aliases]:
            if n in seen:
                problems.append(f"models[{i}] ({m.name}): name {n!r} is already used by model {seen[n]!r}")
            else:
                seen[n] = m.name
    for i, m in enumerate(catalog.models):
        for f in m.fallbacks:
            if f not in seen:
                problems.append(f"models[{i}] ({m.name}).fallbacks: no model or alias named {f!r}")
            elif seen[f] == m.name:
                problems.append(f"models[{i}] ({m.name}).fallbacks: {f!r} is the model itself")
        if m.guard is not None:
            judge = next((g for g in catalog.models if g.name == seen.get(m.guard.model)), None)
            if judge is None:
                problems.append(f"models[{i}] ({m.name}).guard.model: no model or alias named {m.guard.model!r}")
            elif judge.role != "guard" or judge.name == m.name:
                problems.append(f"models[{i}] ({m.name}).guard.model: {m.guard.model!r} is not another model "
                                "with `role: guard`")
        for j, p in enumerate(m.profiles):
            try:
                check_profile(p)
            except PolicyError as exc:
                problems.append(f"models[{i}] ({m.name}).profiles[{j}]: {exc}")
    if problems:
        raise CatalogError(problems)


def load_catalog(path: str | Path) -> Catalog:
    """Read and validate a catalog YAML file."""
    text = Path(path).read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogError([f"{path}: not valid YAML: {exc}"]) from None
    return parse_catalog(raw)

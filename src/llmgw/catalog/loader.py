"""YAML → `Catalog`, with every rule that can be checked before anything runs.

Errors name the field the way an operator wrote it (`models[1] (smollm2-135m).scaling.max`) and say what
to write instead. A catalog that fails any rule is refused whole: nothing is applied half-way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from llmgw.catalog.policy import profile_problems
from llmgw.catalog.rules import check_arithmetic, check_source
from llmgw.catalog.upgrade import upgrade_document
from llmgw.schemas.catalog import LORA_ENGINES, Catalog, Model, Profile, fold_name
from llmgw.spelling import did_you_mean


class CatalogError(ValueError):
    """The catalog cannot be applied. `problems` lists one line per problem, each naming its field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("catalog refused:\n" + "\n".join(f"  - {p}" for p in problems))


def _loc(loc: tuple[Any, ...], raw: Any) -> str:
    """`models[1] (big).profiles[0] (default).nodes`: the path with each list item's name, as the rules
    across the catalog write it (an unnamed profile is `default`)."""
    out = ""
    node = raw
    parent = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            item = node[part] if isinstance(node, list) and part < len(node) else None
            name = item.get("name") if isinstance(item, dict) else None
            if name is None and parent == "profiles" and isinstance(item, dict):
                name = Profile.model_fields["name"].default
            if name:
                out += f" ({name})"
            node = item
        else:
            out += ("." if out else "") + str(part)
            node = node.get(part) if isinstance(node, dict) else None
            parent = part
    return out


def _schema_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The catalog schema class that holds the field at `loc` (its last part), or None."""
    cls: type[BaseModel] = Catalog
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field_info = cls.model_fields.get(str(part))
        if field_info is None:
            return None
        inner = _model_in(field_info.annotation)
        if inner is None:
            return None
        cls = inner
    return cls


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `annotation` (`list[Profile]`, `Scaling | None`, ...), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


# What a mapping field looks like, for a value written as something else (`scaling: on`).
EXAMPLES = {"Scaling": "{min: 1, max: 1}", "Limits": "{max_concurrency: 4, max_queue: 8}",
            "GuardPolicy": "{model: judge, check: [request]}"}


def _written(value: Any) -> str:
    """A value as the writer wrote it, in YAML's words (`on` reads as true), cut short."""
    if value is None:
        return "nothing (an empty value)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (YAML reads on/off, yes/no as true/false)"
    return repr(value)[:60]


def _shape_problem(err: dict, raw: Any) -> str:
    """One pydantic error as a problem line: the field as written, what is wrong, and what to write."""
    loc = tuple(err["loc"])
    where = _loc(loc, raw) or "catalog"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        cls = _schema_at(loc)
        fields = sorted(cls.model_fields) if cls is not None else []
        msg = "unknown field" + (did_you_mean(loc[-1] if loc else None, fields)
                                 or "; check its spelling against docs/catalog.md")
    elif err["type"] in ("model_type", "dict_type", "model_attributes_type"):
        cls = _schema_at((*loc, None))  # the class of the field itself
        if cls is not None:
            example = EXAMPLES.get(cls.__name__)
            msg = (f"must be a mapping of fields ({', '.join(cls.model_fields)}), not "
                   f"{_written(err.get('input'))}" + (f"; for example `{loc[-1]}: {example}`" if example else ""))
    elif err["type"] == "list_type":
        msg = f"must be a list (one `- item` a line, or `[a, b]`), not {_written(err.get('input'))}"
        if loc == ("models",):
            msg += "; each item a model (`- name: my-model` and its profiles)"
    elif err["type"] == "literal_error":
        expected = str((err.get("ctx") or {}).get("expected", ""))  # "'vllm', 'sglang', 'llamacpp' or 'sim'"
        msg += did_you_mean(err.get("input"), re.findall(r"'([^']*)'", expected))
    return f"{where}: {msg}"


@dataclass
class LoadedCatalog:
    """A catalog that passed every rule, with `notes`: the upgrade repairs made to it, each naming its field."""

    catalog: Catalog
    notes: list[str] = field(default_factory=list)


def read_catalog(raw: Any) -> LoadedCatalog:
    """Repair, validate and check a decoded YAML/JSON document. Raises `CatalogError` naming each bad field.

    Order: upgrade repairs on the document (they need to see which fields were written), then the shapes
    (pydantic), then the rules across the catalog (names, fallbacks, arithmetic, sources, engine policy).
    """
    if raw is None:
        raw = {"models": []}
    if isinstance(raw, list):
        raw = {"models": raw}
    if not isinstance(raw, dict):
        raise CatalogError(["the catalog must be a mapping with a `models:` list"])
    raw, notes, problems = upgrade_document(raw)
    indices: list[int] | None = None
    unread: list[str] = []
    try:
        catalog = Catalog.model_validate(raw)
    except ValidationError as exc:
        problems += [_shape_problem(err, raw) for err in exc.errors()]
        catalog, indices, unread = _readable_part(raw)
    try:
        check_catalog(catalog, indices, unread)
    except CatalogError as exc:
        # One report with every problem; a profile the upgrade step already refused is not refused twice.
        refused = tuple({p.split(": ", 1)[0].rsplit(".", 1)[0] + "." for p in problems})
        problems += [p for p in exc.problems if not refused or not p.startswith(refused)]
    if problems:
        raise CatalogError(problems)
    return LoadedCatalog(catalog, notes)


def _readable_part(raw: dict) -> tuple[Catalog, list[int], list[str]]:
    """The models whose shape is right, while another's is not: (a catalog of them, the index each had, the
    names and aliases of the others). The rules across the catalog then run on these, so one apply lists
    both kinds of problem; a model that could not be read still counts as a name (a fallback to it is not
    reported as unknown) and has no rules of its own checked."""
    models = raw.get("models")
    readable: list[Model] = []
    indices: list[int] = []
    unread: list[str] = []
    for i, m in enumerate(models if isinstance(models, list) else []):
        try:
            readable.append(Model.model_validate(m))
            indices.append(i)
        except ValidationError:
            if isinstance(m, dict):
                aliases = m.get("aliases")
                unread += [n for n in [m.get("name"), *(aliases if isinstance(aliases, list) else [])]
                           if isinstance(n, str)]
    return Catalog(models=readable), indices, unread


def parse_catalog(raw: Any) -> Catalog:
    """Validate a decoded YAML/JSON document (see `read_catalog`). Raises `CatalogError`."""
    return read_catalog(raw).catalog


def check_catalog(catalog: Catalog, indices: list[int] | None = None, unread: Sequence[str] = ()) -> None:
    """Cross-model rules, in place: unique names and aliases; fallbacks and guard models that exist, rewritten
    to the model names they resolve to (seeds 003: a typo in a fallback stops the apply instead of surfacing
    during the outage the fallback was for); per profile the arithmetic, the source and the engine policy.
    `indices`: each model's index in the document (when some could not be read); `unread`: the names and
    aliases of those, which exist as far as the others are concerned."""
    problems: list[str] = []
    seen: dict[str, str] = {n: n for n in unread}
    # Two names that differ only in case or `_`/`-` are one name to the people who type them (and the 404's
    # "did you mean" folds them so): `Llama-3` beside `llama_3` would route a typo to the other model.
    folded: dict[str, tuple[str, str]] = {fold_name(n): (n, n) for n in unread}
    at = indices or range(len(catalog.models))
    adapters: set[str] = set()  # names that are adapters, for the messages
    for i, m in zip(at, catalog.models):
        for n in [m.name, *m.aliases, *(a.name for a in m.adapters)]:
            is_adapter = m.adapter(n) is not None and n not in (m.name, *m.aliases)
            if n in seen:
                owner = f"adapter of model {seen[n]!r}" if n in adapters else f"model {seen[n]!r}"
                problems.append(f"models[{i}] ({m.name}): name {n!r} is already used by {owner}")
            elif fold_name(n) in folded and (folded[fold_name(n)][1] != m.name or is_adapter):  # (its own alias may)
                other, owner = folded[fold_name(n)]
                problems.append(f"models[{i}] ({m.name}): name {n!r} differs from {other!r} (model {owner!r}) only "
                                "in case or '_'/'-'; names must differ in more than that: rename one")
            else:
                seen[n] = m.name
                folded.setdefault(fold_name(n), (n, m.name))
                if is_adapter:
                    adapters.add(n)
    for i, m in zip(at, catalog.models):
        problems += adapter_problems(m, f"models[{i}] ({m.name})")
        resolved: list[str] = []
        for f in m.fallbacks:
            if f in adapters:
                problems.append(f"models[{i}] ({m.name}).fallbacks: {f!r} is an adapter; name its base model")
            elif f not in seen:
                problems.append(f"models[{i}] ({m.name}).fallbacks: no model or alias named {f!r}"
                                + did_you_mean(f, [n for n in seen if seen[n] != m.name]))
            elif seen[f] == m.name:
                problems.append(f"models[{i}] ({m.name}).fallbacks: {f!r} is the model itself")
            elif seen[f] not in resolved:
                resolved.append(seen[f])
        m.fallbacks = resolved
        if m.guard is not None and m.guard.model in adapters:
            problems.append(f"models[{i}] ({m.name}).guard.model: {m.guard.model!r} is an adapter, not a guard model")
        elif m.guard is not None and m.guard.model not in unread:
            judge = next((g for g in catalog.models if g.name == seen.get(m.guard.model)), None)
            if judge is None:
                problems.append(f"models[{i}] ({m.name}).guard.model: no model or alias named {m.guard.model!r}"
                                + did_you_mean(m.guard.model, [g.name for g in catalog.models if g.role == "guard"]))
            elif judge.role != "guard" or judge.name == m.name:
                problems.append(f"models[{i}] ({m.name}).guard.model: {m.guard.model!r} is not another model "
                                "with `role: guard`")
            else:
                m.guard.model = judge.name
        for j, p in enumerate(m.profiles):
            where = f"models[{i}] ({m.name}).profiles[{j}] ({p.name})"
            problems += check_arithmetic(p, where)
            problems += check_source(p, where)
            problems += [f"{where}: {problem}" for problem in profile_problems(p)]  # check_source said the source
    if problems:
        raise CatalogError(problems)


def adapter_problems(m: Model, where: str) -> list[str]:
    """A model's adapters against its profiles (issue 40): each profile must serve adapters
    (`Profile.lora_refusal`), and each adapter's `rank` must fit every vLLM/sim profile's `max_lora_rank` (a
    llama.cpp profile takes any rank, and a GGUF file as each adapter's source); a model
    served by static `endpoints` takes none (llmgw does not run its engines)."""
    if not m.adapters:
        return [f"{where}.profiles[{j}] ({p.name}).max_loras: engine {p.engine} does not load adapters at run time; "
                "remove it" for j, p in enumerate(m.profiles) if p.max_loras is not None and p.engine not in LORA_ENGINES]
    if not m.profiles:
        return [f"{where}.adapters: a model served by `endpoints` takes no adapters (llmgw does not run its "
                "engines); add a vllm or sim profile with `max_loras`"]
    problems = []
    for j, p in enumerate(m.profiles):
        refusal = p.lora_refusal()
        if refusal is not None:
            problems.append(f"{where}.profiles[{j}] ({p.name}): the model has adapters, but {refusal}")
            continue
        if p.engine == "llamacpp":  # launched with every adapter: no rank bound; each must be one GGUF file
            problems += [f"{where}.adapters[{k}] ({a.name}).source: {a.source!r} is not a file llama.cpp can load; "
                         "write mirror:NAME.gguf, an http(s) URL of the GGUF, or its path on the node"
                         for k, a in enumerate(m.adapters) if a.source.endswith("/") or not a.source.startswith(
                             ("mirror:", "http://", "https://", "/", "./", "../"))]
            continue
        for k, a in enumerate(m.adapters):
            if a.rank is not None and a.rank > p.lora_rank:
                problems.append(f"{where}.adapters[{k}] ({a.name}).rank: {a.rank} exceeds profile {p.name!r}'s "
                                f"max_lora_rank ({p.lora_rank}{'' if p.max_lora_rank else ', the default'}); "
                                f"write `max_lora_rank: {a.rank}` on the profile")
    return problems


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping: plain YAML keeps the last one, so
    `name: a` then `name: b` in one model would rename it, and an apply would remove model `a`."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:  # the keys as written (a merge `<<: *x` may be overridden, as YAML says)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            first = seen.setdefault((key_node.tag, key_node.value), key_node)
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key_node.value!r} is written twice in one mapping (first on line "
                    f"{first.start_mark.line + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, text: str | None = None) -> Any:
    """The YAML document in `path` (or `text`, read from it). Raises `CatalogError` naming the file, line
    and column and what is wrong there (`catalog.yaml:3:9: not valid YAML: mapping values are not allowed
    here`), not PyYAML's `in "<unicode string>"`."""
    try:
        text = Path(path).read_text(encoding="utf-8") if text is None else text
    except UnicodeDecodeError as exc:
        raise CatalogError([f"{path}: not UTF-8 text (byte {exc.start} cannot be read); save the catalog as "
                            "UTF-8"]) from None
    try:
        return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = "; ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise CatalogError([f"{where}: not valid YAML: {what or exc}"]) from None


def load_catalog(path: str | Path) -> Catalog:
    """Read and validate a catalog YAML file."""
    return parse_catalog(read_yaml(path))

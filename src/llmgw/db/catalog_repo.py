"""Catalog and per-model state (backoff, demand, use). All SQL for them lives here."""

from __future__ import annotations

import json
import logging
from datetime import datetime

from pydantic import ValidationError
from sqlalchemy import Text, bindparam, cast, delete, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.catalog.upgrade import upgrade_model_spec
from llmgw.db import snapshot_reads
from llmgw.db.tables import catalog_models, model_state
from llmgw.schemas import problems_line
from llmgw.schemas.api import ApplyResponse
from llmgw.schemas.catalog import Catalog, Model, name_problem
from llmgw.schemas.payloads import ModelState

log = logging.getLogger(__name__)


class CatalogMemo:
    """The last catalog a reader parsed and the stored specs it came from (issue 13: the route table and the
    snapshot read the catalog on every change and pass). A read that finds the same specs returns the same
    `Catalog`, which its holder treats as read-only, instead of validating every model again."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.catalog: Catalog | None = None
        self.unreadable: dict[str, str] = {}


async def get_catalog(conn: AsyncConnection, memo: CatalogMemo | None = None) -> Catalog:
    """The stored catalog, with the upgrade repairs applied to what an older llmgw stored (seeds 003,
    "Let the upgrade repair"). A stored model that no rule can read any more is left out and logged:
    it could not be placed either way, and the rest of the catalog must keep working (`read_catalog`
    says which). With `memo`, an unchanged catalog is not parsed again."""
    return (await read_catalog(conn, memo))[0]


async def read_catalog(conn: AsyncConnection, memo: CatalogMemo | None = None) -> tuple[Catalog, dict[str, str]]:
    """`get_catalog`, and the stored models it left out: name -> why this version cannot read it. Their
    replicas are kept running and they are shown to the operator (`ctl models`), not taken for removed:
    an upgrade whose rules are stricter must not stop a healthy engine (placement/plan.py)."""
    order = (catalog_models.c.position, catalog_models.c.name)
    key = None
    if memo is None:
        rows = [(r.name, r.spec) for r in (await conn.execute(
            select(catalog_models.c.name, catalog_models.c.spec).order_by(*order))).all()]
    else:  # the specs as Postgres writes them (jsonb's text is canonical): compared, and parsed only when changed
        texts = (await conn.execute(select(catalog_models.c.name, cast(catalog_models.c.spec, Text)).order_by(*order))).all()
        key = json.dumps([list(r) for r in texts], separators=(",", ":"))
        if memo.catalog is not None and key == memo.key:
            return memo.catalog, memo.unreadable
        rows = [(name, json.loads(text)) for name, text in texts]
    models = []
    unreadable: dict[str, str] = {}
    for i, (name, stored_spec) in enumerate(rows):
        spec, _, problems = upgrade_model_spec(stored_spec, i)
        spec = _without_bad_aliases(spec)
        try:
            if problems:
                raise ValueError("; ".join(problems))
            models.append(Model.model_validate(spec))
        except (ValidationError, ValueError) as exc:
            why = _why_unreadable(exc)
            unreadable[name] = why
            log.error("stored catalog model %r cannot be read and is skipped; apply a corrected catalog: %s",
                      stored_spec.get("name") if isinstance(stored_spec, dict) else stored_spec, why)
    catalog = Catalog(models=models)
    if memo is not None:
        memo.key, memo.catalog, memo.unreadable = key, catalog, unreadable
    return catalog, unreadable


def _why_unreadable(exc: Exception) -> str:
    return problems_line(exc, "model", limit=2000) if isinstance(exc, ValidationError) else str(exc)[:2000]


async def stored_names(conn: AsyncConnection, names: list[str]) -> set[str]:
    """Which of `names` the stored catalog holds as a model's name or alias (gateway/misses.py)."""
    aliases = catalog_models.c.spec["aliases"]
    rows = (await conn.execute(select(catalog_models.c.name, aliases).where(
        catalog_models.c.name.in_(names)
        | ((func.jsonb_typeof(aliases) == "array")
           & func.jsonb_exists_any(aliases, bindparam("names", names, type_=ARRAY(Text))))))).all()
    wanted = set(names)
    found = set()
    for name, stored_aliases in rows:
        found |= ({name} | {a for a in stored_aliases or [] if isinstance(a, str)}) & wanted
    return found


def _without_bad_aliases(spec: object) -> object:
    """A stored model with an alias an older llmgw took (empty, `x/../y`, a newline) keeps serving under its
    name and its other aliases: the alias is left out and logged, not the whole model."""
    aliases = spec.get("aliases") if isinstance(spec, dict) else None
    if not isinstance(aliases, list):
        return spec
    bad = [a for a in aliases if name_problem(a)]
    if not bad:
        return spec
    log.error("stored catalog model %r: aliases %r are not names any more and are left out; apply a corrected "
              "catalog", spec.get("name"), bad)
    return {**spec, "aliases": [a for a in aliases if a not in bad]}


def _spec(m: Model) -> dict:
    return m.model_dump(mode="json", exclude_defaults=True)


def _flatten(value, prefix: str = "") -> dict[str, object]:
    """{"scaling": {"max": 2}} → {"scaling.max": 2}; lists of profiles by their names (an unnamed one alone
    is `default`, as the rules call it), never by position."""
    out: dict[str, object] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            name = v.get("name")
            key = name if isinstance(name, str) else "default" if len(value) == 1 else i
            out |= _flatten({k: x for k, x in v.items() if k != "name"}, f"{prefix}[{key}]")
    else:
        out[prefix] = value
    return out


OFF = "(none): off, it does not run; write `scaling: {max: 1}` to load it on demand"


def _profile_names(spec: dict) -> dict[str, dict]:
    profiles = spec.get("profiles") or []
    return {p.get("name") if isinstance(p.get("name"), str) else "default": {k: v for k, v in p.items() if k != "name"}
            for p in profiles if isinstance(p, dict)}


def field_changes(old: Model, new: Model) -> list[str]:
    """One line per field that differs: `scaling.max: 1 -> 2`, `profiles[default].tp: (unset) -> 4`; a profile
    renamed with nothing else changed is one line (`profiles: big renamed to large`), and a scaling stanza
    removed is said to switch the model off."""
    before, after = _spec(old), _spec(new)
    lines = []
    was, now = _profile_names(before), _profile_names(after)
    gone, came = [n for n in was if n not in now], [n for n in now if n not in was]
    for name in gone:
        same = next((n for n in came if now[n] == was[name]), None)
        if same is not None:
            came.remove(same)
            lines.append(f"profiles: {name} renamed to {same}")
            before = {**before, "profiles": [{**p, "name": same} if (p.get("name") or "default") == name else p
                                             for p in before.get("profiles", [])]}
    a, b = _flatten(before), _flatten(after)
    if "scaling" in before and "scaling" not in after:
        a = {k: v for k, v in a.items() if not k.startswith("scaling.")}
        lines.append(f"scaling: {', '.join(f'{k} {v}' for k, v in before['scaling'].items())} -> {OFF}")
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            lines.append(f"{key}: {a.get(key, '(unset)')!s} -> {b.get(key, '(unset)')!s}")
    return lines


async def diff_catalog(conn: AsyncConnection, catalog: Catalog) -> ApplyResponse:
    """What applying `catalog` would change, by model name, with the fields of each changed model. A stored
    model this version cannot read is `changed` when `catalog` names it, `removed` when it does not."""
    stored, unreadable = await read_catalog(conn)
    current = {m.name: m for m in stored.models}
    out = ApplyResponse()
    for m in catalog.models:
        old = current.pop(m.name, None)
        if old is None and m.name in unreadable:
            out.changed.append(m.name)
            out.changes[m.name] = [f"(the stored entry, which this version cannot read: {unreadable.pop(m.name)}) "
                                   "-> as written"]
        elif old is None:
            out.added.append(m.name)
            if m.scaling is None:
                out.changes[m.name] = [f"scaling: {OFF}"]
        elif _spec(old) != _spec(m):
            out.changed.append(m.name)
            out.changes[m.name] = field_changes(old, m)
        else:
            out.unchanged.append(m.name)
    out.removed = sorted(set(current) | set(unreadable))
    return out


async def apply_catalog(conn: AsyncConnection, catalog: Catalog) -> ApplyResponse:
    """Replace the catalog with `catalog` in the caller's transaction; returns the diff it applied."""
    diff = await diff_catalog(conn, catalog)
    if diff.removed:
        await conn.execute(delete(catalog_models).where(catalog_models.c.name.in_(diff.removed)))
    for pos, m in enumerate(catalog.models):
        stmt = insert(catalog_models).values(name=m.name, position=pos, spec=_spec(m))
        await conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[catalog_models.c.name],
                set_={"position": pos, "spec": stmt.excluded.spec, "updated_at": func.now()},
            )
        )
        await conn.execute(insert(model_state).values(name=m.name).on_conflict_do_nothing())
    diff.applied = True
    return diff


async def model_states(conn: AsyncConnection) -> list[ModelState]:
    """Every model's state, with its load summed over the live gateways (db/load_repo.py)."""
    return await snapshot_reads.snapshot_model_states(conn)


async def record_demand(conn: AsyncConnection, name: str, renewal: bool = False) -> None:
    """A request asked for `name` while no replica was Ready (load on demand). Not counted while the model
    backs off after a failed start: that request is answered at once (503 model_failing, Retry-After the
    backoff left), and a client that retries then asks again; one that gives up does not start a broken model.
    A `renewal` (a request held since before, keeping its demand fresh) is recorded only if no start has
    failed since the demand recorded last: that failure spent it (placement/scale.py), whatever the request
    read before. The database decides both, so a failure counted a moment ago is never missed."""
    st = model_state.c
    counts = st.backoff_until.is_(None) | (st.backoff_until <= func.now())
    if renewal:
        counts = counts & (st.failed_at.is_(None) | st.demand_at.is_(None) | (st.failed_at < st.demand_at))
    stmt = insert(model_state).values(name=name, demand_at=func.now())
    await conn.execute(stmt.on_conflict_do_update(index_elements=[st.name], set_={"demand_at": func.now()},
                                                  where=counts))


async def record_use(conn: AsyncConnection, name: str, at: datetime | None = None) -> None:
    """A request for `name` ended: the idle clock restarts from here."""
    value = at or func.now()
    stmt = insert(model_state).values(name=name, last_used_at=value)
    await conn.execute(stmt.on_conflict_do_update(
        index_elements=[model_state.c.name],
        set_={"last_used_at": func.greatest(model_state.c.last_used_at, stmt.excluded.last_used_at)},
    ))


async def record_failure(conn: AsyncConnection, name: str, backoff_until: datetime) -> int:
    """Count a failed replica start against the model and hold placements until `backoff_until`; the time
    it was counted (`failed_at`) tells the planner whether an on-demand model was asked for since."""
    stmt = insert(model_state).values(name=name, failures=1, backoff_until=backoff_until, failed_at=func.now())
    row = (await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[model_state.c.name],
            set_={"failures": model_state.c.failures + 1, "backoff_until": backoff_until, "failed_at": func.now()},
        ).returning(model_state.c.failures)
    )).one()
    return row.failures


async def reset_failures(conn: AsyncConnection, name: str) -> None:
    """A start reached Ready, or `ctl retry`: no failed starts, no backoff, and the demand before the last
    failure counts again."""
    await conn.execute(update(model_state).where(model_state.c.name == name)
                       .values(failures=0, backoff_until=None, failed_at=None))


async def record_idle_stops(conn: AsyncConnection, names: list[str]) -> None:
    """The models a pass stops to zero for want of requests (placement/scale.py `_floor` reads it back)."""
    if names:
        await conn.execute(update(model_state).where(model_state.c.name.in_(names)).values(idle_stopped_at=func.now()))


async def save_decisions(conn: AsyncConnection, decisions: dict[str, list[str]]) -> None:
    """Keep the latest pass's lines per model, with the time of the pass, for `llmgw ctl explain`."""
    if not decisions:
        return
    # One statement with one parameter, the whole pass as one JSON object that Postgres takes apart: as
    # 5k rows of parameters (executemany) the statement cost the control worker ~60 ms a pass (issue 42).
    each = func.jsonb_each(bindparam("decisions", decisions, type_=JSONB)).table_valued("key", "value")
    stmt = insert(model_state).from_select(["name", "decisions", "decided_at"],
                                           select(each.c.key, each.c.value, func.now()))
    await conn.execute(stmt.on_conflict_do_update(index_elements=[model_state.c.name],
                                                  set_={"decisions": stmt.excluded.decisions, "decided_at": func.now()}))


async def get_decisions_at(conn: AsyncConnection, name: str) -> tuple[list[str] | None, datetime | None]:
    """(the latest pass's lines about `name` ([] before any pass), when that pass ran); (None, None) for a
    model the catalog never had."""
    row = (await conn.execute(select(model_state.c.decisions, model_state.c.decided_at)
                              .where(model_state.c.name == name))).first()
    return (row.decisions or [], row.decided_at) if row else (None, None)

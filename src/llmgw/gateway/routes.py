"""The gateway's route table: which Ready replicas serve each model, read from Postgres.

Refreshed by the `ChangeFeed` (db/feed.py) when replicas or the catalog change and on a short timer,
since a node going silent changes nothing in the tables. Only `ready` replicas are routed: Draining,
Starting and ended ones get no new requests, nor do replicas on an Unreachable node: one whose heartbeats
and pollers have both been silent for `unreachable_after_s` (placement/liveness.py; the pollers as the
control worker last recorded them, and only while it has been recording them). A model whose Ready replicas
are all on Unreachable nodes is named in `unreachable`, so a client is told that rather than "loading".
Static `endpoints` of a model are routed as they are. Aliases resolve to their model. Never read from
Temporal. Each replica's engine key (reported by its node) rides in its `Target`, and the upstream client
sends it with every request. A LoRA adapter's name resolves (`adapter`) to its base's route and the adapter;
each endpoint carries the adapters its replica holds (`replica_adapters`, read only while the catalog has
adapters) and its profile's `max_loras` (gateway/adapters.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import difflib
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.catalog.context import MAX_PROMPT_CHARS, OutputBound, PromptBound, output_bound, prompt_bound, text_only
from llmgw.db import adapters_repo, catalog_repo, fleet_repo
from llmgw.gateway.isolation import SALTED, engine_class
from llmgw.gateway.misses import MissCheck
from llmgw.gateway.resume import continues_chat
from llmgw.gateway.upstream import Target, parse_target
from llmgw.placement.liveness import witness_status
from llmgw.schemas.catalog import Adapter, Catalog, Model, fold_name
from llmgw.schemas.inventory import AdapterFile

log = logging.getLogger(__name__)
TABLES = {"replicas", "catalog_models", "nodes"}  # what the route table is read from
SIMILAR_MAX = 256  # the longest unknown name a 404 looks for a similar one to (a model name's limit)


@dataclass
class Endpoint:
    """One Ready replica (or static endpoint) as this gateway sees it.

    `outstanding`: this gateway's requests in flight to it. `failures`, `open_until` (event-loop time)
    and `trial`: its circuit breaker (gateway/balancer.py). Kept across refreshes, keyed by replica id.
    `kind`: how its prefix cache is isolated (gateway/isolation.py `engine_class` of its engine).
    """

    replica_id: str
    url: str
    node_id: str
    target: Target
    kind: str = SALTED
    continues_chat: bool = False  # its engine continues a final assistant message (gateway/resume.py)
    seed: int = field(init=False, default=0)  # its replica id hashed: its score in prefix balancing

    def __post_init__(self) -> None:
        self.seed = int.from_bytes(hashlib.blake2b(self.replica_id.encode(), digest_size=8).digest(), "big")
    outstanding: int = 0
    failures: int = 0
    open_until: float = 0.0
    trial: bool = False
    max_loras: int = 0  # adapters its replica may hold at once (its profile's; 0: none)
    engine: str = "unknown"  # its profile's engine ("unknown": a static endpoint; llama.cpp's adapters per request)
    native: bool | None = None  # its engine serves Anthropic's Messages itself (gateway/dialects.py); None: not known yet
    native_retry_at: float = 0.0  # (event-loop time) when its version, unreadable, is asked again
    queue_retry_at: float = 0.0  # (event-loop time) when its engine's queue, unreadable, is asked again
    adapters_changed: int = 0  # bumped by each load or unload this gateway makes (gateway/adapters.py)
    # The LoRA adapters its replica holds, least recently used first (gateway/adapters.py).
    adapters: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    # Its adapter files as its node fetched and verified them (`shards.adapters`): the path a load gives the
    # engine, or why none may be loaded; llama.cpp's launch ids (gateway/adapters.py).
    adapter_files: dict[str, AdapterFile] = field(default_factory=dict)


@dataclass
class ModelRoute:
    model: Model
    bound: PromptBound  # the longest prompt it takes (catalog/context.py)
    text_only: bool = False  # no replica of it reads images or audio (catalog/context.py)
    endpoints: list[Endpoint] = field(default_factory=list)
    output: OutputBound | None = None  # what a choice without a length cap may generate (catalog/context.py)

    def __post_init__(self) -> None:
        if self.output is None:
            self.output = output_bound(self.model, self.bound)


class RouteTable:
    """Model name or alias -> `ModelRoute`. `on_refresh(catalog)` hooks run after every refresh."""

    def __init__(self, engine: AsyncEngine, unreachable_after_s: float, poller_grace_s: float = 60.0,
                 max_prompt_chars: int = MAX_PROMPT_CHARS):
        self.engine = engine
        self.max_prompt_chars = max_prompt_chars
        self.unreachable_after_s = unreachable_after_s
        self.poller_grace_s = poller_grace_s
        self.unreachable: dict[str, list[str]] = {}  # model -> Unreachable nodes its Ready replicas are on
        self.catalog = Catalog()
        self.models: dict[str, ModelRoute] = {}
        self.names: dict[str, str] = {}  # name or alias -> canonical name
        self.adapters: dict[str, tuple[str, Adapter]] = {}  # adapter name -> (its base model, the adapter)
        self._endpoints: dict[str, Endpoint] = {}
        self.changed = asyncio.Condition()
        self._catalog_memo = catalog_repo.CatalogMemo()  # an unchanged catalog is not parsed again per refresh
        self._loaded = False  # a refresh has read the catalog
        self.on_refresh: list[Callable[[Catalog], None]] = []
        # Read-your-writes for `ctl apply` (gateway/misses.py): the gateway sets `ask_refresh` (mark the
        # catalog changed in its feed); `lookup` waits for a refresh begun after a miss was found stored.
        self.misses = MissCheck(engine)
        self.ask_refresh: Callable[[], None] | None = None
        self._begun = 0  # refreshes begun
        self._finished = 0  # the latest finished refresh, by the number it began with
        self._unreadable: set[str] = set()  # stored names the catalog read leaves out (until it changes)

    def resolve(self, name: str) -> ModelRoute | None:
        canonical = self.names.get(name)
        return self.models.get(canonical) if canonical else None

    def adapter(self, name: str) -> tuple[ModelRoute, Adapter] | None:
        """The base model's route and the adapter, for an adapter's name (None: not an adapter)."""
        found = self.adapters.get(name)
        route = self.models.get(found[0]) if found is not None else None
        return (route, found[1]) if route is not None and found is not None else None

    async def lookup(self, name: str, wait_s: float = 2.0) -> ModelRoute | None:
        """`resolve`, and on a miss make sure the name is not in the stored catalog by now: a model applied a
        moment ago is served, not 404 (gateway/misses.py). Waits at most `wait_s` for the refresh."""
        route = self.resolve(name)
        if route is not None or self.ask_refresh is None or not self._loaded or name in self._unreadable:
            return route
        if not await self.misses.stored(name):
            return None
        begun = self._begun
        self.ask_refresh()
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self._finished > begun), wait_s)
        except TimeoutError:
            log.warning("model %r is in the stored catalog but the route table did not refresh in %.1f s", name, wait_s)
            return self.resolve(name)
        route = self.resolve(name)
        if route is None:
            self._unreadable.add(name)
        return route

    def similar(self, name: str, usable: Callable[[Model], bool] | None = None) -> str | None:
        """The model name or alias a caller who asked for the unknown `name` most likely meant, among those
        `usable` lets it use: the same name in another case or spacing, else the closest spelling. Only for
        the 404 path (a linear scan of the catalog's names); a name longer than any a catalog holds gets none."""
        if len(name) > SIMILAR_MAX:
            return None
        folded = {fold_name(n): n for n, canonical in self.names.items()
                  if usable is None or (canonical in self.models and usable(self.models[canonical].model))}
        asked = fold_name(name.strip())
        if asked in folded:
            return folded[asked]
        close = difflib.get_close_matches(asked, list(folded), n=1, cutoff=0.75)
        return folded[close[0]] if close else None

    def fallbacks(self, route: ModelRoute) -> list[ModelRoute]:
        """The routes of `route`'s fallbacks, in catalog order (resolved at catalog load, seeds 003)."""
        out = []
        for name in route.model.fallbacks:
            r = self.resolve(name)
            if r is not None and r is not route:
                out.append(r)
        return out

    def _endpoint(self, key: str, url: str, node_id: str, api_key: str | None = None,
                  kind: str = SALTED, continues_chat: bool = False, engine: str = "unknown") -> Endpoint | None:
        url = url.rstrip("/")
        auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        ep = self._endpoints.get(key)
        if ep is not None and ep.url == url and ep.target.auth == auth and ep.kind == kind and ep.engine == engine:
            ep.continues_chat = continues_chat
            return ep
        try:
            if "\r" in (api_key or "") or "\n" in (api_key or ""):
                raise ValueError("its engine key is not a header value")
            return Endpoint(key, url, node_id, dataclasses.replace(parse_target(url), auth=auth), kind=kind,
                            continues_chat=continues_chat, engine=engine)
        except ValueError as exc:
            log.warning("not routing to %s: %s", key, exc)
            return None

    async def refresh(self, changed: set[str] | None = None) -> None:
        """Reload catalog and Ready replicas; keep each endpoint's counters and breaker. `changed`: the tables
        that changed since the last refresh (db/feed.py; None: unknown), so a change of replicas only
        does not read the catalog again."""
        reuse = changed is not None and "catalog_models" not in changed and self._loaded
        self._begun += 1
        number = self._begun
        # A load or unload this gateway makes while the rows are read is newer than them: that endpoint's
        # adapters are kept as they are (the next refresh reads the rows it wrote).
        changes = {rid: ep.adapters_changed for rid, ep in self._endpoints.items()}
        async with self.engine.connect() as conn:
            catalog = self.catalog if reuse else await catalog_repo.get_catalog(conn, self._catalog_memo)
            rows = await fleet_repo.routable_replicas(conn, self.unreachable_after_s)
            with_adapters = any(m.adapters for m in catalog.models)
            held = await adapters_repo.held(conn) if with_adapters else []
        # The observers' ages come on every row (with no row there is nothing to judge by them).
        observer_age, pollers_age = (rows[0].observer_age_s, rows[0].pollers_age_s) if rows else (None, None)
        models = {m.name: ModelRoute(m, prompt_bound(m, self.max_prompt_chars), text_only(m)) for m in catalog.models}
        names: dict[str, str] = {}
        adapters: dict[str, tuple[str, Adapter]] = {}
        for m in catalog.models:
            names[m.name] = m.name
            for a in m.aliases:
                names.setdefault(a, m.name)
            for ad in m.adapters:
                adapters.setdefault(ad.name, (m.name, ad))
        holding: dict[str, list[str]] = {}
        for h in held:
            holding.setdefault(h.replica_id, []).append(h.adapter)
        seen: dict[str, Endpoint] = {}
        for m in catalog.models:
            for i, url in enumerate(m.endpoints):  # static endpoints: engines run elsewhere
                key = f"static:{m.name}:{i}"
                ep = self._endpoint(key, url, "static")
                if ep is not None:
                    seen[key] = ep
                    models[m.name].endpoints.append(ep)
        unreachable: dict[str, list[str]] = {}
        for r in rows:
            if r.model not in models:
                continue
            live = witness_status(r.node_age_s, r.poll_age_s, observer_age, pollers_age, self.unreachable_after_s,
                                  float("inf"), self.poller_grace_s, r.poll_read_age_s)
            if live.status != "ready":
                unreachable.setdefault(r.model, []).append(r.node_id)
                continue
            profile = models[r.model].model.profile(r.profile)
            ep = self._endpoint(r.replica_id, r.endpoint, r.node_id, r.api_key,
                                engine_class(profile.engine if profile is not None else "unknown"),
                                profile is not None and continues_chat(profile),
                                profile.engine if profile is not None else "unknown")
            if ep is not None:
                seen[r.replica_id] = ep
                models[r.model].endpoints.append(ep)
                ep.max_loras = (profile.max_loras or 0) if profile is not None else 0
                ep.adapter_files = _adapter_files(r.replica_id, r.adapter_files) if with_adapters else {}
                if changes.get(r.replica_id, ep.adapters_changed) == ep.adapters_changed:
                    _sync_adapters(ep, holding.get(r.replica_id, []))
        if catalog is not self.catalog:
            self._unreadable.clear()
        self.catalog, self.models, self.names, self._endpoints = catalog, models, names, seen
        self.adapters = adapters
        self._loaded = True
        self.unreachable = {m: sorted(set(ns)) for m, ns in unreachable.items()}
        for hook in self.on_refresh:
            hook(catalog)
        async with self.changed:
            self._finished = max(self._finished, number)
            self.changed.notify_all()

    async def wait_for_endpoint(self, name: str, timeout_s: float) -> ModelRoute | None:
        """Wait up to `timeout_s` for `name` to have a Ready replica (load on demand)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self.changed:
            while True:
                route = self.resolve(name)
                if route and route.endpoints:
                    return route
                left = deadline - loop.time()
                if left <= 0:
                    return route
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except TimeoutError:
                    return self.resolve(name)


def _adapter_files(replica_id: str, raw: object) -> dict[str, AdapterFile]:
    """A replica's recorded adapter files; {} when none or unreadable (its fetched adapters are then refused
    as not verified, never loaded from a path nobody checked)."""
    try:
        return {str(k): AdapterFile.model_validate(v) for k, v in (raw or {}).items()}  # type: ignore[union-attr]
    except (ValueError, AttributeError):
        log.warning("replica %s: its recorded adapter files cannot be read; its fetched adapters are refused",
                    replica_id)
        return {}


def _sync_adapters(ep: Endpoint, stored: list[str]) -> None:
    """`ep`'s adapters as recorded (`stored`, oldest used first): this gateway's order for those it knows,
    the ones another gateway loaded counted as least recently used here."""
    known = set(stored)
    ordered = [n for n in stored if n not in ep.adapters] + [n for n in ep.adapters if n in known]
    if list(ep.adapters) != ordered:
        ep.adapters = collections.OrderedDict.fromkeys(ordered)

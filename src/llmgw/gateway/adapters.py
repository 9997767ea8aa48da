"""LoRA adapters in the gateway (issue 40): which replica serves a request that names an adapter, and
loading the adapter there when no replica holds it.

- A request whose `model` is an adapter goes to a Ready replica of its base that holds it loaded (the
  balancer's choice among those). When none does, the balancer picks one of the base's replicas (the fewest
  in flight) and the adapter is loaded into it with the engine's runtime call, vLLM's
  `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (the sim engine implements it), sent with the
  replica's engine key as every request is. The request waits meanwhile, up to `adapter_load_timeout_s`
  (a streaming one is held as for a cold start: 200 and an SSE comment every `HOLD_TICK_S`); a request for
  the same adapter arriving during the load is sent to the replica loading it and waits on the
  same load (one load per replica at a time).
- A hot adapter spreads: when its least busy holder has `SPREAD_AFTER` (4) more requests in flight than the
  least busy replica of the base without it, that replica is a candidate too, and the balancer's pick (the
  fewest in flight) loads it there; it is not unloaded from the first. One load of an adapter at a time.
- A replica holds at most its profile's `max_loras` adapters: loading one more first unloads the one this
  gateway used least recently there (`POST /v1/unload_lora_adapter`). The order is this gateway's; what
  is loaded where is recorded in `replica_adapters` (db/adapters_repo.py), which every gateway reads on its
  route refresh (gateway/routes.py), so the others route to it too.
- An adapter whose source the node fetches (`mirror:`, http(s)) is loaded from the node's verified copy, the
  path its node recorded for the replica (`shards.adapters`, read on the route refresh); one whose file
  failed verification there is never loaded: its request gets 503 `adapter_unverified` with the node's words.
- An engine that answers an adapter's request with 404 (it lost it: restarted) is forgotten as holding it,
  and the request is sent again once (gateway/proxy.py), which loads it anew.
"""

from __future__ import annotations

import asyncio
import json
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.db import adapters_repo
from llmgw.gateway.demand import HOLD_TICK_S, Hold
from llmgw.gateway.routes import Endpoint
from llmgw.gateway.upstream import Upstream, UpstreamError
from llmgw.http.errors import APIError
from llmgw.schemas.catalog import Adapter, LaunchAdapter

log = logging.getLogger(__name__)
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
ALREADY = "has already been loaded"  # vLLM's 400 for a name it holds (serving_models.py): loaded, then
MAX_ENGINE_ANSWER = 16 << 10
# An adapter whose every holder has this many more requests in flight than the least busy replica of its base
# without it is loaded there too (`AdapterLoads.holders`).
SPREAD_AFTER = 4


class AdapterLoads:
    """Loads and unloads adapters in replicas for the proxy. `engine`: where the holdings are recorded (None:
    not recorded, in unit tests); `timeout_s`: the longest one load (with its unload) may take."""

    def __init__(self, engine: AsyncEngine | None, upstream: Upstream, timeout_s: float = 120.0):
        self.engine = engine
        self.upstream = upstream
        self.timeout_s = timeout_s
        self._locks: dict[str, asyncio.Lock] = {}  # replica id -> one load or unload at a time
        self.loading: dict[str, str] = {}  # adapter -> the replica loading it now
        self.loads = 0  # loads done by this gateway (for tests and metrics)
        self.evictions = 0

    def holders(self, endpoints: list[Endpoint], name: str, tried: set[str]) -> list[Endpoint]:
        """The endpoints among `endpoints` that hold adapter `name` or are loading it, not yet `tried`; and,
        when the adapter is hot (its least busy holder has `SPREAD_AFTER` more requests in flight than the
        least busy replica without it), that replica too, so the balancer's pick loads it there: a hot
        adapter spreads over more replicas instead of queueing on the first that loaded it."""
        loading = self.loading.get(name)
        held = [ep for ep in endpoints if (name in ep.adapters or ep.replica_id == loading)
                and ep.replica_id not in tried]
        if not held or loading is not None:  # one load of an adapter at a time
            return held
        others = [ep for ep in endpoints if ep not in held and ep.replica_id not in tried]
        if others:
            idle = min(others, key=lambda ep: ep.outstanding)
            if min(ep.outstanding for ep in held) >= idle.outstanding + SPREAD_AFTER:
                return [*held, idle]
        return held

    @staticmethod
    def used(ep: Endpoint, name: str) -> None:
        """A request for adapter `name` was sent to `ep`: it is now its most recently used."""
        if name in ep.adapters:
            ep.adapters.move_to_end(name)

    async def ensure(self, ep: Endpoint, model: str, adapter: Adapter, hold: Hold | None = None) -> None:
        """Make `adapter` (of base `model`) loaded in `ep`, unloading its least recently used adapters first
        while it holds `max_loras`. Raises `APIError` (503 `adapter_load_failed`, 504 past the timeout).
        `hold(waited_s)` is awaited every `HOLD_TICK_S` while it loads (a stream's SSE comments)."""
        if adapter.name in ep.adapters:
            return
        if ep.engine == "llamacpp":  # launched with its adapters: chosen per request (`lora_field`), not loaded
            launch_id(ep, adapter)
            return
        if hold is None:
            return await self._ensure(ep, model, adapter)
        loop = asyncio.get_running_loop()
        started = loop.time()
        task = asyncio.ensure_future(self._ensure(ep, model, adapter))
        try:
            while not (await asyncio.wait({task}, timeout=HOLD_TICK_S))[0]:
                await hold(loop.time() - started)
            return task.result()
        finally:
            if not task.done():  # the client left: the load goes on for the next request of it
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _ensure(self, ep: Endpoint, model: str, adapter: Adapter) -> None:
        lock = self._locks.setdefault(ep.replica_id, asyncio.Lock())
        self.loading.setdefault(adapter.name, ep.replica_id)
        try:
            async with lock:
                if adapter.name in ep.adapters:  # loaded by the request this one waited behind
                    return
                await asyncio.wait_for(self._load(ep, model, adapter), self.timeout_s)
        except TimeoutError:
            raise APIError(504, f"the adapter `{adapter.name}` did not load within {self.timeout_s:g}s",
                           type="upstream_error", param="model", code="adapter_load_timeout") from None
        finally:
            if self.loading.get(adapter.name) == ep.replica_id:
                del self.loading[adapter.name]

    async def _load(self, ep: Endpoint, model: str, adapter: Adapter) -> None:
        path = lora_path(ep, adapter)  # before any unload: an unverified adapter changes nothing
        while ep.adapters and len(ep.adapters) >= max(1, ep.max_loras):
            victim = next(iter(ep.adapters))  # the least recently used
            status, text = await self._call(ep, UNLOAD, {"lora_name": victim})
            if status not in (200, 404):  # 404: it holds it no more, which is what was asked
                raise _failed(adapter.name, f"unloading `{victim}` to make room answered HTTP {status}: {text}")
            await self._record(adapters_repo.record_unloaded, ep.replica_id, victim)
            ep.adapters.pop(victim, None)
            ep.adapters_changed += 1
            self.evictions += 1
            log.info("unloaded adapter %s from %s (least recently used; max_loras %d)", victim, ep.replica_id,
                     ep.max_loras)
        status, text = await self._call(ep, LOAD, {"lora_name": adapter.name, "lora_path": path})
        if status != 200 and not (status == 400 and ALREADY in text):
            raise _failed(adapter.name, f"the engine answered HTTP {status}: {text}")
        await self._record(adapters_repo.record_loaded, ep.replica_id, model, adapter.name)
        ep.adapters[adapter.name] = None
        ep.adapters.move_to_end(adapter.name)  # (a refresh may have put the row in first, as another's)
        ep.adapters_changed += 1
        self.loads += 1
        log.info("loaded adapter %s into %s", adapter.name, ep.replica_id)

    def forget(self, ep: Endpoint, name: str) -> None:
        """`ep`'s engine does not hold `name` after all (it answered 404): route as if it never had; the row
        is deleted in the background (the next load writes it again)."""
        ep.adapters.pop(name, None)
        ep.adapters_changed += 1
        if self.engine is not None:
            asyncio.get_running_loop().create_task(self._record(adapters_repo.record_unloaded, ep.replica_id, name))

    async def _call(self, ep: Endpoint, path: str, body: dict) -> tuple[int, str]:
        """POST `body` to the engine behind its key: (status, the answer's text, cut short)."""
        try:
            resp = await self.upstream.post(ep.target, path, json.dumps(body).encode())
            status = resp.status  # (release resets the response for its connection's next use)
            try:
                data = await resp.read(MAX_ENGINE_ANSWER)
            finally:
                resp.release()
        except UpstreamError as exc:
            raise _failed(body["lora_name"], f"the replica could not be reached ({exc})") from None
        text = data.decode("utf-8", "replace")
        try:  # vLLM's error envelope: say its message, not the JSON around it
            text = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        return status, str(text)[:300]

    async def _record(self, fn, *args) -> None:
        """Write a holding; a database error is logged, not the request's failure (the engine holds what it
        holds; other gateways learn it later, or from a 404)."""
        if self.engine is None:
            return
        try:
            async with self.engine.begin() as conn:
                await fn(conn, *args)
        except Exception:  # noqa: BLE001 - logged with its traceback, routing goes on
            log.exception("recording adapter holding %s failed", args)


def lora_path(ep: Endpoint, adapter: Adapter) -> str:
    """What `ep`'s engine is told to load for `adapter`: the node's verified copy of a fetched source
    (`mirror:`, http(s)), else the source untouched (a path on the node, a hub id). Raises `APIError` 503
    `adapter_unverified` when the node's copy failed verification or was never fetched (the replica started
    before the adapter was added: the rollout of the change replaces it): the engine never gets its load."""
    if not LaunchAdapter(name=adapter.name, source=adapter.source).fetched:
        return adapter.source
    got = ep.adapter_files.get(adapter.name)
    if got is not None and got.path and not got.error:
        return got.path
    raise _unverified(ep, adapter)


def launch_id(ep: Endpoint, adapter: Adapter) -> int:
    """`adapter`'s id among the adapters `ep`'s llama-server was launched with; raises `APIError` 503
    `adapter_unverified` when it was launched without it (its file failed, or the replica predates it)."""
    got = ep.adapter_files.get(adapter.name)
    if got is not None and got.id is not None and got.path and not got.error:
        return got.id
    raise _unverified(ep, adapter)


def lora_field(ep: Endpoint, adapter: Adapter | None) -> list[dict]:
    """llama-server's per-request `lora` for `ep`: every launched adapter, at scale 1 for the one asked for and
    0 for the rest (one left out keeps its launch scale), so a request for the base, or one carrying a `lora`
    of its own, gets no adapter it was not allowed."""
    chosen = launch_id(ep, adapter) if adapter is not None else None
    ids = sorted(f.id for f in ep.adapter_files.values() if f.id is not None and f.path and not f.error)
    return [{"id": i, "scale": 1.0 if i == chosen else 0.0} for i in ids]


def _unverified(ep: Endpoint, adapter: Adapter) -> APIError:
    got = ep.adapter_files.get(adapter.name)
    why = (f"its file failed verification on node {ep.node_id}: {got.error}" if got is not None and got.error else
           f"replica {ep.replica_id} started before it was added (the rollout of the change replaces it)")
    log.warning("adapter %s not loaded into %s: %s", adapter.name, ep.replica_id, why)
    return APIError(503, f"the adapter `{adapter.name}` cannot be loaded: {why}", type="upstream_error",
                    param="model", code="adapter_unverified", headers={"Retry-After": "30"})


def _failed(name: str, why: str) -> APIError:
    return APIError(503, f"the adapter `{name}` could not be loaded: {why}", type="upstream_error", param="model",
                    code="adapter_load_failed", headers={"Retry-After": "5"})

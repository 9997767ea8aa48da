"""What operators and clients are shown about models and replicas: statuses with their causes (failing,
with restarts and backoff, like Kubernetes' CrashLoopBackOff), replicas with their decoded failures and
Temporal UI links, engine logs read on the node, and clearing a model's backoff. Used by the admin API
(`llmgw ctl`); the gateway reads the same statuses itself (db/status_repo.py, placement/model_status.py)
for its 503 answers, `/v1/models` and the chat page."""

from __future__ import annotations

import logging
import re
import uuid
from datetime import timedelta
from urllib.parse import quote

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import WorkflowFailureError
from temporalio.service import RPCError

from llmgw.db import adapters_repo, catalog_repo, fleet_repo, status_repo
from llmgw.http.errors import APIError
from llmgw.placement.model_status import ModelCondition, ModelFacts, ModelStatus, failure_cause, model_condition
from llmgw.schemas.api import LogsView, ModelView, ReplicaView, RetryResult, ShardView
from llmgw.schemas.payloads import ReadShardLogInput, ReadShardLogResult, ShardLogInput
from llmgw.schemas.status import ReplicaStatus
from llmgw.security.logtext import printable
from llmgw.spelling import did_you_mean
from llmgw.temporal import LazyClient
from llmgw.workflows import attributes
from llmgw.workflows.ids import replica_history_query, replica_logs_id
from llmgw.workflows.queues import CONTROL_QUEUE

log = logging.getLogger(__name__)
REPLICA_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def not_found(what: str, param: str) -> APIError:
    return APIError(404, what, param=param, code="not_found")


class StatusService:
    """Bound to the database and (for logs, retries and links) the Temporal client and its UI."""

    def __init__(self, engine: AsyncEngine, temporal: LazyClient | None = None, temporal_ui: str = "",
                 namespace: str = "default"):
        self.engine = engine
        self.temporal = temporal
        self.temporal_ui = temporal_ui.rstrip("/")
        self.namespace = namespace

    # ---- models --------------------------------------------------------------------------------
    async def models(self) -> list[ModelView]:
        async with self.engine.connect() as conn:
            catalog, unreadable = await catalog_repo.read_catalog(conn)
            now, facts = await status_repo.model_facts(conn)
            created = await status_repo.catalog_created(conn)
            held = await adapters_repo.held(conn) if any(m.adapters for m in catalog.models) else []
        out = []
        for m in catalog.models:
            f = facts.get(m.name, ModelFacts())
            c = model_condition(m, f, now)
            sc = m.effective_scaling
            mode = "off" if sc.off else "on demand" if sc.on_demand else f"min {sc.min}"
            out.append(ModelView(
                name=m.name, aliases=m.aliases, fallbacks=m.fallbacks, engines=sorted({p.engine for p in m.profiles}),
                min=sc.min, max=sc.max, mode=mode, priority=m.priority, role=m.role, simulated=m.simulated,
                replicas=dict(sorted(f.replicas.items())), status=c.status.value, reason=c.reason, ready=c.ready,
                restarts=c.restarts, replaced=f.replaced, retry_in_s=c.retry_in_s, on_request=c.on_request,
                last_failure=c.last_failure, created_at=created.get(m.name),
                adapters={a.name: [h.replica_id for h in held if h.adapter == a.name and h.model == m.name]
                          for a in m.adapters} if m.adapters else None))
        for name, why in unreadable.items():  # stored, but this version cannot read it: its replicas are kept
            f = facts.get(name, ModelFacts())
            out.append(ModelView(
                name=name, replicas=dict(sorted(f.replicas.items())), status="unreadable", replaced=f.replaced,
                reason=(f"this version cannot read its stored entry ({printable(why, 600)}); its replicas keep running, not "
                        "routed: apply a catalog that writes it the way `ctl apply` takes, or leaves it out"),
                created_at=created.get(name)))
        return out

    async def retry(self, name: str) -> RetryResult:
        """Clear `name`'s failed-start count and backoff (after its cause was fixed) and wake the reconciler."""
        async with self.engine.begin() as conn:
            catalog = await catalog_repo.get_catalog(conn)
            model = catalog.get(name) or next((m for m in catalog.models if name in m.aliases), None)
            if model is None:
                raise not_found(f"no model or alias named {name!r} in the catalog"
                                + did_you_mean(name, [n for m in catalog.models for n in (m.name, *m.aliases)]), "model")
            now, facts = await status_repo.model_facts(conn, [model.name])
            f = facts.get(model.name, ModelFacts())
            await catalog_repo.reset_failures(conn, model.name)
        left = max(0, int((f.backoff_until - now).total_seconds())) if f.backoff_until else 0
        if self.temporal is not None:
            await self.temporal.wake(f"retry {model.name}")
        return RetryResult(model=model.name, failures=f.failures, backoff_left_s=left,
                           on_demand=model.effective_scaling.on_demand)

    # ---- replicas ------------------------------------------------------------------------------
    async def replicas(self, include_ended: bool = False, model: str | None = None, limit: int = 200) -> list[ReplicaView]:
        """Replicas, newest first. Without `include_ended`: the active ones, and the latest failed replica of
        every model that is failing (a crash-looping model is never an empty list)."""
        async with self.engine.connect() as conn:
            catalog = await catalog_repo.get_catalog(conn)
            now, facts = await status_repo.model_facts(conn)
            rows = list(await fleet_repo.list_replicas(conn, include_ended=include_ended, model=model, limit=limit))
            conds = {m.name: model_condition(m, facts.get(m.name, ModelFacts()), now) for m in catalog.models}
            if not include_ended:
                failing = [f.last_failed_replica for name, f in facts.items()
                           if f.last_failed_replica and name in conds and conds[name].status == ModelStatus.FAILING
                           and (model is None or name == model)]
                if failing:
                    rows += await fleet_repo.list_replicas(conn, ids=failing)
                    rows.sort(key=lambda r: r.created_at, reverse=True)
        links = await self._links_by_attribute()
        latest = {name: f.last_failed_replica for name, f in facts.items()}
        return [self.view(r, conds.get(r.model), links, latest.get(r.model)) for r in rows]

    def view(self, r: fleet_repo.ReplicaRow, cond: ModelCondition | None = None, links_by_attribute: bool = False,
             latest_failed: str | None = None) -> ReplicaView:
        """One replica's row. Only its model's latest failed replica carries the model's restarts and the
        time to its next start: an older failed one has been retried already."""
        shards = [ShardView(node_id=s.node_id, rank=s.rank, gpus=s.gpus, status=s.status, progress=s.progress,
                            exit_code=s.exit_code, exit_reason=s.exit_reason) for s in r.shards]
        cause = failure_cause(r.failure, [(s.rank, s.node_id, s.exit_reason or "") for s in shards]) \
            if r.status in (ReplicaStatus.FAILED, ReplicaStatus.LOST) else None
        failing = (cond is not None and cond.status == ModelStatus.FAILING and r.status == ReplicaStatus.FAILED
                   and r.id == latest_failed)
        return ReplicaView(
            id=r.id, model=r.model, profile=r.profile, status=r.status, node_id=r.node_id,
            endpoint=r.endpoint, created_at=r.created_at, ready_at=r.ready_at, failure=r.failure,
            shards=shards, reason=r.reason, ended_reason=r.ended_reason, cause=cause,
            restarts=cond.restarts if failing and cond else 0, retry_in_s=cond.retry_in_s if failing and cond else None,
            on_request=bool(failing and cond and cond.on_request),
            temporal_url=self.temporal_link(r.id, links_by_attribute), profile_hash=r.profile_hash)

    def temporal_link(self, replica_id: str, by_attribute: bool) -> str | None:
        """The Temporal UI listing this replica's workflows (start and stop)."""
        if not self.temporal_ui:
            return None
        if by_attribute:
            query = f'LlmgwReplica="{replica_id}"'
        else:
            query = replica_history_query(replica_id)
        return f"{self.temporal_ui}/namespaces/{quote(self.namespace, safe='')}/workflows?query={quote(query, safe='')}"

    async def _links_by_attribute(self) -> bool:
        if self.temporal is None:
            return False
        return await self.temporal.attributes.registered(self.temporal.client)

    async def resolve(self, ref: str) -> str:
        """A replica id from an id or its first characters (8 are printed); 404 when none, 400 when ambiguous
        or not shaped like a replica id."""
        if not REPLICA_REF.fullmatch(ref):
            raise APIError(400, f"{ref[:80]!r} is not a replica id: give the id `llmgw ctl replicas` prints (letters, "
                           "digits and '-', up to 64)", param="replica", code="bad_replica_id")
        async with self.engine.connect() as conn:
            found = await fleet_repo.find_replicas(conn, ref)
        if ref in found:
            return ref
        if len(found) == 1:
            return found[0]
        if not found:
            raise not_found(f"no replica whose id starts with {ref!r}; `llmgw ctl replicas --all` lists them", "replica")
        raise APIError(400, f"{ref!r} matches several replicas ({', '.join(f[:12] for f in found)}); give more of the id",
                       param="replica", code="ambiguous")

    # ---- logs ----------------------------------------------------------------------------------
    async def logs(self, ref: str, rank: int, offset: int, limit: int) -> LogsView:
        """Part of the engine log of `ref`'s shard `rank`, read on its node by the node worker; when the node
        does not answer, the output it last reported (kept on the shard, and in the replica's failure)."""
        replica_id = await self.resolve(ref)
        async with self.engine.connect() as conn:
            shard = await fleet_repo.shard_row(conn, replica_id, rank)
            [rep] = await fleet_repo.list_replicas(conn, ids=[replica_id])
        if shard is None:
            ranks = ", ".join(str(s.rank) for s in rep.shards) or "none"
            raise not_found(f"replica {replica_id[:8]} has no shard of rank {rank} (ranks: {ranks})", "rank")
        view = LogsView(replica_id=replica_id, model=rep.model, rank=rank, node_id=shard.node_id, shard_id=shard.id)
        try:
            got = await self._read_on_node(view, rep.model, offset, limit)
        except _NodeSilent as exc:
            stored = shard.output_tail or _tail_of(rep.failure)
            return view.model_copy(update=dict(
                from_node=False, data=stored if offset < 0 else "", found=bool(stored), offset=max(offset, 0),
                note=f"node {shard.node_id} did not answer ({exc}); " +
                     ("this is the output it last reported" if stored else "no output was reported")))
        return view.model_copy(update=dict(data=got.data, offset=got.offset, size=got.size, found=got.found,
                                           running=got.running))

    async def _read_on_node(self, view: LogsView, model: str, offset: int, limit: int) -> ReadShardLogResult:
        client = self.temporal.client if self.temporal else None
        if client is None:
            raise _NodeSilent("Temporal is not reachable from the admin API yet")
        registered = await self.temporal.attributes.registered(client)  # type: ignore[union-attr]
        try:
            return await client.execute_workflow(
                "ShardLogWorkflow",
                ShardLogInput(node_id=view.node_id, model=model,
                              read=ReadShardLogInput(shard_id=view.shard_id, offset=offset, limit=limit)),
                id=replica_logs_id(view.replica_id, uuid.uuid4().hex[:8]), task_queue=CONTROL_QUEUE,
                result_type=ReadShardLogResult, execution_timeout=timedelta(seconds=40),
                memo=attributes.memo(model),
                search_attributes=attributes.lifecycle("logs", model, view.replica_id, [view.node_id])
                if registered else None)
        except WorkflowFailureError as exc:
            cause = exc.cause
            while getattr(cause, "cause", None) is not None:
                cause = cause.cause
            raise _NodeSilent(getattr(cause, "message", None) or str(cause)) from None
        except RPCError as exc:
            raise _NodeSilent(f"Temporal refused the read: {exc}") from None


class _NodeSilent(Exception):
    pass


def _tail_of(failure: str | None) -> str:
    """The engine output kept in a failure text (after its `last output:` line), or ''."""
    if not failure or "last output:\n" not in failure:
        return ""
    return failure.split("last output:\n", 1)[1]

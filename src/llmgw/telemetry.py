"""Prometheus metrics and OpenTelemetry tracing. Off costs nothing: no provider, no interceptor.

Tracing follows a replica's start across processes: the Temporal tracing interceptor carries the span
context in workflow and activity headers, so the reconciler's pass, the `ReplicaStartWorkflow` on the
control worker and `fetch_weights` / `launch_shard` / `wait_shard_ready` on the node share one trace.

Gateway metric labels are bounded: `model` is a catalog model's name, or `unknown` for requests that never
resolved to one (a client-chosen string never becomes a label); `status` is an HTTP status code, with 499
for a client that went away; `stage` is `request` or `response`.
"""

from __future__ import annotations

import json
import os
import threading
from bisect import bisect_left
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from llmgw.schemas.status import ReplicaStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ACTIVATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# Inter-token latency: engines stream a token every 5-100 ms; a gap of seconds is a stall worth seeing.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
_HOLDING = tuple(s for s in ReplicaStatus if s in ReplicaStatus.holding())  # llmgw_replicas' statuses, in order


class GapCounts:
    """One model's inter-token gaps: bucket counts and their sum, added to on the event loop only (no lock)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


class Gaps:
    """A histogram by model observed once per relayed chunk, so kept cheaper than prometheus_client's
    `Histogram` (a lock and a walk of the buckets per observation: 4 us a chunk, measured, against the relay's
    50-60 us per event; this costs a bisect and two additions). Rendered as a Prometheus histogram at
    scrape time."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]):
        self.name = name
        self.doc = doc
        self.bounds = bounds
        self.models: dict[str, GapCounts] = {}

    def of(self, model: str) -> GapCounts:
        c = self.models.get(model)
        if c is None:
            c = self.models[model] = GapCounts(self.bounds)
        return c

    def forget(self, models: set[str]) -> None:
        for m in models:
            self.models.pop(m, None)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["model"])
        for model, c in list(self.models.items()):
            counts, total = list(c.counts), 0
            buckets = []
            for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), counts):
                total += n
                buckets.append((bound, total))
            family.add_metric([model], buckets, c.sum)
        yield family


class GatewayMetrics:
    """The gateway's metrics, on their own registry (rendered at `/metrics`).

    - `llmgw_requests_total{model,status}`: inference requests by outcome;
    - `llmgw_request_seconds{model}`: until the last byte; `llmgw_ttft_seconds{model}`: until the first
      byte of a streamed answer reached the client (time to first token); `llmgw_itl_seconds{model}`: the
      gaps between the chunks of a streamed answer relayed after its first (inter-token latency; an engine
      writes a token a chunk, so each gap is one token's, or a few tokens' when it writes several at once);
    - `llmgw_in_flight{model}`: requests this gateway holds (queued ones included); `llmgw_queued{model}`:
      those waiting for a concurrency slot;
    - `llmgw_ready_replicas{model}`, `llmgw_open_breakers{model}`: from the route table, at scrape time;
    - `llmgw_upstream_retries_total{model}`: requests sent to another replica before the first byte (and
      streams' continuations); `llmgw_stream_resumes_total{model,outcome}`: streams whose engine died or
      stalled mid-answer, `resumed` on another replica or `failed` (gateway/resume.py);
    - `llmgw_guard_refusals_total{model,stage}`;
    - `llmgw_activation_seconds{model,rung}`: a request held because its model had no Ready replica, from its
      arrival to its first token (a streamed answer) or its answer, by the rung it was held for: `wake` (the
      model was sleeping: a replica woken) or `start` (a replica started; whether from weights on the node or
      fetched is in the start's decision, `ctl explain`) (issue 39);
    - `llmgw_usage_missing_total{model}` (accounted requests that ended without usage),
      `llmgw_usage_sync_errors_total`;
    - tenants, on a registry of their own (`tenant_registry`, rendered by `render_tenants` on the admin
      API's `/metrics`, which wants the admin token: issue 36, the public port had named every tenant with
      its usage; issue 15: `tenant` is a tenant this gateway knows, or `-` for a key of no tenant, at most
      `MAX_TENANTS`): `llmgw_tokens_total{tenant,model,type}` (`prompt`, `completion`: what the engines
      reported for accounted requests), `llmgw_rate_limited_total{tenant,limit}` (`rpm`, `tpm`,
      `tokens_per_day`, `tokens_per_month`, `models`), `llmgw_tenant_ttft_seconds{tenant}` (time to the first
      streamed byte of an accounted request, by tenant: a tenant queued behind others under fair queuing
      shows it here first).
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("llmgw_requests", "Inference requests", ["model", "status"], registry=r)
        self.latency = Histogram("llmgw_request_seconds", "Request duration until the last byte (s)", ["model"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("llmgw_ttft_seconds", "Time to the first streamed byte relayed to the client (s)",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Gaps("llmgw_itl_seconds", "Gaps between the chunks of a streamed answer relayed (s)", ITL_BUCKETS)
        r.register(self.itl)
        self.in_flight = Gauge("llmgw_in_flight", "Requests this gateway holds, queued ones included", ["model"],
                               registry=r)
        self.queued = Gauge("llmgw_queued", "Requests waiting for a concurrency slot or for a load", ["model"], registry=r)
        self.slots = Gauge("llmgw_model_slots", "Requests this gateway forwards to a model at once now: its "
                           "max_concurrency, lowered while its engines queue (gateway/engine_queues.py)", ["model"],
                           registry=r)
        self.ready = Gauge("llmgw_ready_replicas", "Routable replicas per model in the route table", ["model"],
                           registry=r)
        self.open_breakers = Gauge("llmgw_open_breakers", "Endpoints whose circuit breaker is open", ["model"],
                                   registry=r)
        self.retries = Counter("llmgw_upstream_retries", "Requests retried on another replica before the first byte",
                               ["model"], registry=r)
        self.stream_resumes = Counter("llmgw_stream_resumes", "Streams whose engine died or stalled mid-answer, by "
                                      "outcome: resumed on another replica, or failed (one error event)",
                                      ["model", "outcome"], registry=r)
        self.guard_refusals = Counter("llmgw_guard_refusals", "Requests or responses refused by a guard model",
                                      ["model", "stage"], registry=r)
        self.activation = Histogram("llmgw_activation_seconds", "A request held for its model to come up (no Ready "
                                    "replica), arrival to first token, by rung: wake or start (s)",
                                    ["model", "rung"], buckets=ACTIVATION_BUCKETS, registry=r)
        t = self.tenant_registry = CollectorRegistry()  # never on the public port
        self.tokens = Counter("llmgw_tokens", "Tokens the engines reported for accounted requests",
                              ["tenant", "model", "type"], registry=t)
        self.rate_limited = Counter("llmgw_rate_limited", "Requests refused by a tenant's or key's limits",
                                    ["tenant", "limit"], registry=t)
        self.tenant_ttft_seconds = Histogram("llmgw_tenant_ttft_seconds", "Time to the first streamed byte by tenant (s)",
                                             ["tenant"], buckets=TTFT_BUCKETS, registry=t)
        self.usage_missing = Counter("llmgw_usage_missing", "Accounted requests that ended without usage",
                                     ["model"], registry=r)
        self.usage_sync_errors = Counter("llmgw_usage_sync_errors", "Usage syncs with Postgres that failed",
                                         registry=r)
        self._children: dict[tuple, tuple] = {}
        self._tokens: dict[tuple[str, str], tuple] = {}
        self._tenant_ttft: dict[str, Any] = {}
        self._gauged: set[str] = set()  # models whose route-table gauges are set
        # Every metric with a `model` label, and its label names: a model's series go with it (`forget`).
        self._by_model = [(m, names) for m, names in (
            (self.requests, ("model", "status")), (self.latency, ("model",)), (self.ttft, ("model",)),
(self.in_flight, ("model",)), (self.queued, ("model",)), (self.slots, ("model",)), (self.ready, ("model",)),
            (self.open_breakers, ("model",)), (self.retries, ("model",)), (self.guard_refusals, ("model", "stage")),
            (self.stream_resumes, ("model", "outcome")), (self.activation, ("model", "rung")),
            (self.tokens, ("tenant", "model", "type")), (self.usage_missing, ("model",)))]

    def begin(self, model: str) -> None:
        self._model(model)[2].inc()

    def activated(self, model: str, rung: str, seconds: float) -> None:
        """A held request's first token (`llmgw_activation_seconds`); `rung` is "wake" or "start"."""
        self.activation.labels(model, rung).observe(seconds)

    def end(self, model: str) -> None:
        self._model(model)[2].dec()

    def _model(self, model: str) -> tuple:
        c = self._children.get((model,))
        if c is None:
            c = self._children[(model,)] = (self.latency.labels(model), self.ttft.labels(model),
                                            self.in_flight.labels(model))
        return c

    def observe(self, model: str, status: int, seconds: float, ttft_s: float | None = None) -> None:
        """One finished request: its outcome, duration and, for a stream, time to first byte (seconds)."""
        self._count(model, status)
        lat, ttft, _ = self._model(model)
        lat.observe(seconds)
        if ttft_s is not None:
            ttft.observe(ttft_s)

    def itl_of(self, model: str) -> "GapCounts":
        """`llmgw_itl_seconds` of `model`, to observe each gap of one stream."""
        return self.itl.of(model)

    def tenant_ttft(self, tenant: str, seconds: float) -> None:
        h = self._tenant_ttft.get(tenant)
        if h is None:
            h = self._tenant_ttft[tenant] = self.tenant_ttft_seconds.labels(tenant)
        h.observe(seconds)

    def unauthorized(self) -> None:
        """A /v1/ request refused for its key (401), before any model was read: counted as model `unknown`
        in `llmgw_requests_total` (no latency: it never reached the proxy)."""
        self._count("unknown", 401)

    def _count(self, model: str, status: int) -> None:
        key = (model, status)
        counter = self._children.get(key)
        if counter is None:
            counter = self._children[key] = self.requests.labels(model, str(status))
        counter.inc()

    def count_tokens(self, tenant: str, model: str, prompt: int, completion: int) -> None:
        c = self._tokens.get((tenant, model))
        if c is None:
            c = self._tokens[(tenant, model)] = (self.tokens.labels(tenant, model, "prompt"),
                                                 self.tokens.labels(tenant, model, "completion"))
        c[0].inc(prompt)
        c[1].inc(completion)

    def refused(self, tenant: str, limit: str) -> None:
        self.rate_limited.labels(tenant, limit).inc()

    def route_gauges(self, model: str, ready: int, open_breakers: int, queued: int, slots: int | None = None) -> None:
        """The route table's gauges of one model, at scrape time (`slots`: its gate's, when it has one with a bound)."""
        self._gauged.add(model)
        if slots is not None:
            self.slots.labels(model).set(slots)
        self.ready.labels(model).set(ready)
        self.open_breakers.labels(model).set(open_breakers)
        self.queued.labels(model).set(queued)

    def forget(self, models: set[str]) -> None:
        """Keep series only for `models` (the catalog's, after each route refresh) and `unknown`: a removed
        model's series leave `/metrics` (its last `llmgw_ready_replicas` would say it is still served), once
        this gateway holds none of its requests. Cheap when no model was removed."""
        known = {k[0] for k in self._children} | {k[1] for k in self._tokens} | self._gauged
        gone = known - models - {"unknown"}
        if not gone:
            return
        busy = {s.labels["model"] for fam in self.in_flight.collect() for s in fam.samples if s.value}
        gone -= busy  # its requests still end on their series; forgotten at a later refresh
        for metric, names in self._by_model:
            i = names.index("model")
            keys = {tuple(s.labels.get(n, "") for n in names) for fam in metric.collect() for s in fam.samples}
            for key in keys:
                if key[i] in gone:
                    metric.remove(*key)
        self._children = {k: v for k, v in self._children.items() if k[0] not in gone}
        self._tokens = {k: v for k, v in self._tokens.items() if k[1] not in gone}
        self.itl.forget(gone)
        self._gauged -= gone

    def render(self) -> bytes:
        """The public port's page: per-model series only, no tenant's name."""
        return generate_latest(self.registry)

    def render_tenants(self) -> bytes:
        """The tenant-labelled series, for the admin API's `/metrics` (behind the admin token)."""
        return generate_latest(self.tenant_registry)


class AgentMetrics:
    """Node worker metrics.

    - `llmgw_gpu_nvlink_peers{gpu,uuid}`: NVLink peers per GPU as NVML reports them; zero on every GPU of
      a fleet means the topology is unknown (no NVML), not absent (seeds 001);
    - `llmgw_node_downloads_in_flight`, `llmgw_node_download_bytes`: weight downloads running now and the
      bytes they have so far (read at scrape time); `llmgw_node_fetched_bytes_total`: bytes of completed
      fetches (a cache hit adds nothing);
    - `llmgw_node_activities_refused_total{activity,reason}`: node activities refused because their origin is
      not proven (security/activity_origin.py: unsigned, forged, expired, other_node, other_workflow, ...).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.nvlink_peers = Gauge("llmgw_gpu_nvlink_peers", "NVLink peers of each GPU (0 everywhere = unknown)",
                                  ["gpu", "uuid"], registry=self.registry)
        self.shards = Gauge("llmgw_node_shards", "Engine shards this node runs, by state", ["state"],
                            registry=self.registry)
        self.downloads = Gauge("llmgw_node_downloads_in_flight", "Weight downloads in progress on this node",
                               registry=self.registry)
        self.download_bytes = Gauge("llmgw_node_download_bytes", "Bytes fetched so far by downloads in progress",
                                    registry=self.registry)
        self.fetched = Counter("llmgw_node_fetched_bytes", "Bytes of weight fetches completed on this node",
                               registry=self.registry)
        self.fetched_from_peers = Counter("llmgw_node_peer_fetched_bytes",
                                          "Of those, bytes received from peer nodes rather than the mirror (issue 39)",
                                          registry=self.registry)
        self.refused_activities = Counter("llmgw_node_activities_refused",
                                          "Node activities refused: their origin is not proven",
                                          ["activity", "reason"], registry=self.registry)

    def watch_downloads(self, downloads: dict) -> None:
        """Read the in-flight gauges from `downloads` (replica id -> DownloadProgress) at scrape time."""
        self.downloads.set_function(lambda: len(downloads))
        self.download_bytes.set_function(lambda: sum(d.bytes for d in list(downloads.values())))

    def set_gpus(self, gpus) -> None:
        for g in gpus:
            self.nvlink_peers.labels(str(g.index), g.uuid).set(len(g.nvlink_peers))

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=self.registry)


# Time to ready: seconds to an hour and more (a 400 GB model over a slow link, a cold compile).
READY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
PASS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
REFUSAL_REASONS = ("node_unavailable", "engine", "disk", "memory", "gpu_memory", "gpu", "fabric", "other")


def refusal_reason(text: str) -> str:
    """A bounded reason for one candidate refused by placement (`placement/fit.py`, `fabric.py` words):
    one of `REFUSAL_REASONS`. The free text, with its numbers, stays in `ctl explain`."""
    t = text.lower()
    for reason, words in (("node_unavailable", ("node is ",)), ("engine", ("engine ",)), ("fabric", ("fabric",)),
                          ("disk", ("of disk",)), ("memory", ("host memory",)), ("gpu_memory", ("gb each",)),
                          ("gpu", ("gpu",))):
        if any(w in t for w in words):
            return reason
    return "other"


class _ModelGauges:
    """The control worker's per-model gauges, made from the latest snapshot's figures when scraped."""

    def __init__(self) -> None:
        self.latest: tuple[list[str], dict, dict, Any] = ([], {}, {}, None)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        models, counts, states, now = self.latest
        replicas = GaugeMetricFamily("llmgw_replicas", "Active replicas by model and status (latest snapshot)",
                                     labels=["model", "status"])
        failed = GaugeMetricFamily("llmgw_model_failed_starts", "Consecutive failed starts of a model", labels=["model"])
        backoff = GaugeMetricFamily("llmgw_model_backoff_seconds", "Seconds until a failing model may start again",
                                    labels=["model"])
        for name in models:
            for status in _HOLDING:
                replicas.add_metric([name, str(status)], counts.get((name, status), 0))
            st = states.get(name)
            failed.add_metric([name], st.failures if st else 0)
            left = (st.backoff_until - now).total_seconds() if st and st.backoff_until else 0.0
            backoff.add_metric([name], max(0.0, left))
        return [replicas, failed, backoff]


class ControlMetrics:
    """The control worker's metrics (`llmgw worker`, `/metrics` on `control_metrics_port`). Labels are
    bounded: `model` is a catalog model's name, `status` a replica status, `kind` a decision kind,
    `reason` one of `REFUSAL_REASONS`, `outcome` `ready` or `failed`. With several control workers each
    counts the activities it ran (sum them); the gauges are each one's latest snapshot (take the max).

    - `llmgw_reconcile_passes_total`, `llmgw_reconcile_pass_seconds`: passes, and from the pass's start
      (workflow time) until its decisions were recorded;
    - `llmgw_reconcile_decisions_total{kind}`: place, stop, evict, lost, cleanup, refuse, wait, keep, rollout, sleep, wake;
    - `llmgw_placement_refusals_total{reason}`: candidates turned down, by reason;
    - `llmgw_replicas{model,status}`: active replicas by model and status, from the latest snapshot;
    - `llmgw_model_failed_starts{model}`, `llmgw_model_backoff_seconds{model}`: consecutive failed starts
      and the backoff left (a model in CrashLoopBackOff);
    - `llmgw_replica_starts_total{model,outcome}`: starts that reached Ready or failed;
    - `llmgw_replica_time_to_ready_seconds{model}`: from placement to Ready;
    - `llmgw_reconcilers_replaced_total{cause}`: reconciler runs this worker replaced because their workflow
      task kept failing, by the cause Temporal recorded (`non_deterministic_error` after a deploy that broke
      replay; `unknown`, `timed_out`, or another `WorkflowTaskFailedCause` in lower case).
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.passes = Counter("llmgw_reconcile_passes", "Reconcile passes", registry=r)
        self.pass_seconds = Histogram("llmgw_reconcile_pass_seconds", "Reconcile pass, start to decisions recorded (s)",
                                      buckets=PASS_BUCKETS, registry=r)
        self.decisions = Counter("llmgw_reconcile_decisions", "Reconcile decisions by kind", ["kind"], registry=r)
        self.refusals = Counter("llmgw_placement_refusals", "Placement candidates turned down, by reason", ["reason"],
                                registry=r)
        self._models = _ModelGauges()  # llmgw_replicas, llmgw_model_failed_starts, llmgw_model_backoff_seconds
        r.register(self._models)
        self.starts = Counter("llmgw_replica_starts", "Replica starts by outcome", ["model", "outcome"], registry=r)
        self.time_to_ready = Histogram("llmgw_replica_time_to_ready_seconds", "Placement to Ready (s)", ["model"],
                                       buckets=READY_BUCKETS, registry=r)
        self.reconcilers_replaced = Counter("llmgw_reconcilers_replaced", "Reconciler runs replaced as wedged, "
                                            "by their failed workflow task's cause", ["cause"], registry=r)

    def snapshot(self, snapshot) -> None:
        """Keep a reconcile snapshot's (`schemas.payloads.Snapshot`) figures for the model gauges: every catalog
        model gets a value for each active status, and models that left the catalog lose their series. The
        series are made when scraped (`_ModelGauges`), not every pass: a child gauge per model and status
        cost 90 ms a pass at 1,000 models (issue 42)."""
        counts: dict[tuple[str, str], int] = {}
        for rep in snapshot.replicas:
            counts[(rep.model, rep.status)] = counts.get((rep.model, rep.status), 0) + 1
        self._models.latest = ([m.name for m in snapshot.models], counts,
                               {s.name: s for s in snapshot.model_states}, snapshot.now)

    def recorded(self, kinds: list[str], refusals: dict[str, list[str]], pass_s: float | None) -> None:
        """One pass's decisions were recorded: count them, their refusals, and the pass."""
        self.passes.inc()
        if pass_s is not None and pass_s >= 0:
            self.pass_seconds.observe(pass_s)
        for k in kinds:
            self.decisions.labels(k).inc()
        for lines in refusals.values():
            for line in lines:
                if line.startswith("  "):  # an indented line is one candidate turned down
                    self.refusals.labels(refusal_reason(line)).inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=self.registry)


_tracing_on = False


class MirrorMetrics:
    """The mirror worker's metrics, on the mirror's listener at `/metrics`. `version` is `<name>/<version>`
    of a `mirror add` in progress on this worker (bounded by what operators mirror; removed when done).

    - `llmgw_mirror_download_bytes{version}`: bytes of the version on disk so far (files being fetched);
    - `llmgw_mirror_download_size_bytes{version}`: their announced size (absent while unknown);
    - `llmgw_mirror_fetched_bytes_total`: bytes received from origins (a resume does not count twice);
    - `llmgw_mirror_published_total`, `llmgw_mirror_fetch_failures_total{retryable}`.
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.bytes = Gauge("llmgw_mirror_download_bytes", "Bytes fetched so far of files being mirrored", ["version"],
                           registry=r)
        self.size = Gauge("llmgw_mirror_download_size_bytes", "Announced size of files being mirrored", ["version"],
                          registry=r)
        self.fetched = Counter("llmgw_mirror_fetched_bytes", "Bytes received from origins", registry=r)
        self.requests = Counter("llmgw_mirror_requests", "Requests the byte listener answered, by what they asked for: "
                                "file (a file's bytes), head (its size and sha256 alone), manifest, index", ["kind"],
                                registry=r)
        self.published = Counter("llmgw_mirror_published", "Versions published", registry=r)
        self.failures = Counter("llmgw_mirror_fetch_failures", "File fetch attempts that failed", ["retryable"],
                                registry=r)
        self._files: dict[str, dict[str, tuple[int, int | None]]] = {}
        self._lock = threading.Lock()

    def progress(self, version: str, file: str, n: int | None, total: int | None) -> None:
        """One file's bytes so far (None: the file's fetch ended here)."""
        with self._lock:
            files = self._files.setdefault(version, {})
            if n is None:
                files.pop(file, None)
            else:
                files[file] = (n, total)
            if not files:
                self._files.pop(version, None)
                for g in (self.bytes, self.size):
                    try:
                        g.remove(version)
                    except KeyError:
                        pass
                return
            self.bytes.labels(version).set(sum(b for b, _ in files.values()))
            totals = [t for _, t in files.values()]
            if None in totals:
                try:
                    self.size.remove(version)
                except KeyError:
                    pass
            else:
                self.size.labels(version).set(sum(totals))  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)


_tracing_on = False


def tracing_enabled() -> bool:
    return _tracing_on


class JsonLinesExporter:
    """A span exporter writing one JSON object per span to a file (for `tracing: file:<dir>`)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock, open(self.path, "a") as f:
            for s in spans:
                ctx = s.get_span_context()
                parent = s.parent.span_id if s.parent else None
                f.write(json.dumps({
                    "name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                    "parent_id": f"{parent:016x}" if parent else None, "service": s.resource.attributes.get("service.name"),
                    "start": s.start_time, "end": s.end_time,
                    "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (s.attributes or {}).items()},
                }) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def trace_route(model: str, replica: str, policy: str, reason: str, attempt: int) -> None:
    """A span for one routing choice of the gateway (called only while tracing is on): which replica of
    `model` a request was sent to, by which `policy`, and why (gateway/balancer.py `Choice.reason`)."""
    from opentelemetry import trace

    trace.get_tracer("llmgw.gateway").start_span("gateway route", attributes={
        "llmgw.model": model, "llmgw.replica": replica, "llmgw.balancing": policy, "llmgw.route.reason": reason,
        "llmgw.route.attempt": attempt}).end()


def setup_tracing(spec: str, service: str) -> bool:
    """Install a tracer provider for `service` according to `spec` (see `Settings.tracing`). False when off."""
    global _tracing_on
    if not spec or spec == "off":
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if spec == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif spec.startswith("file:"):
        d = Path(spec[len("file:"):])
        d.mkdir(parents=True, exist_ok=True)
        # Batched, so exporting never runs on a workflow's thread (the sandbox forbids file access there).
        provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(d / f"{service}-{os.getpid()}.jsonl"),
                                                       schedule_delay_millis=200))
    elif spec.startswith("otlp:"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise SystemExit("tracing otlp: needs `pip install opentelemetry-exporter-otlp-proto-http`") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=spec[len("otlp:"):])))
    else:
        raise SystemExit(f"unknown tracing setting {spec!r}: write off, console, file:<dir> or otlp:<endpoint>")
    trace.set_tracer_provider(provider)
    _tracing_on = True
    return True


def shutdown_tracing() -> None:
    """Flush and stop the tracer provider, if tracing is on (spans still batched are exported)."""
    if not _tracing_on:
        return
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()

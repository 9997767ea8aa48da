"""Temporal client connection, with the data converter every llmgw client and worker uses (`data_converter`)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from pydantic import TypeAdapter
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter
from temporalio.converter import (
    CompositePayloadConverter, DataConverter, DefaultPayloadConverter, JSONPlainPayloadConverter,
)

from llmgw.config import Settings
from llmgw.version import VERSION

log = logging.getLogger(__name__)


class _TolerantJSON(PydanticJSONPlainPayloadConverter):
    """temporalio's pydantic JSON converter, reading every payload with unknown fields ignored, at every
    depth. A fleet runs two versions during an upgrade (docs/operating.md, "Upgrading llmgw"): a newer
    control plane's activity input, or a newer node's result, may carry a field this version does not
    know. The payload models themselves ignore unknown fields (`schemas/payloads.py`); this reaches the
    models they embed that forbid them for their operators' sake (a catalog `Profile` inside a
    `LaunchShardInput`: a typo in a catalog is an error, a newer field on the wire is not)."""

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        hint = type_hint if type_hint is not None else Any
        try:
            adapter = self._type_adapter(hint)
        except TypeError:  # an unhashable hint: not cached (as the parent does)
            adapter = TypeAdapter(hint)
        return adapter.validate_json(payload.data, extra="ignore")


class TolerantPayloadConverter(CompositePayloadConverter):
    """The default payload converters with JSON read by `_TolerantJSON` (as `PydanticPayloadConverter`)."""

    def __init__(self) -> None:
        json_converter = _TolerantJSON()
        super().__init__(*(json_converter if isinstance(c, JSONPlainPayloadConverter) else c
                           for c in DefaultPayloadConverter.default_encoding_payload_converters))


# What every llmgw Temporal client, worker and replayer uses (with a payload codec when a payload key is set:
# `data_converter(settings)`). Payloads are written exactly as `pydantic_data_converter` writes them
# (histories are unchanged); only reading tolerates unknown fields.
WIRE_CONVERTER = DataConverter(payload_converter_class=TolerantPayloadConverter)


def identity() -> str:
    """This process's Temporal identity: Temporal's default (`pid@host`) with the llmgw version, so the
    Temporal UI and `temporal task-queue describe` show which version polls a queue during an upgrade."""
    return f"{os.getpid()}@{socket.gethostname()} llmgw/{VERSION}"


def workflow_runner(sandbox_own_modules: bool = False):
    """The sandbox every workflow runs in. Pydantic and OpenTelemetry pass through: payload models keep
    their identity, and spans made inside workflows reach the process's tracer provider rather than a
    sandboxed no-op one.

    On the workers llmgw's own modules pass through too: the sandbox otherwise imports the workflow's module
    afresh for every run, which made a replica start's first workflow task 40-80 ms slower on the cold-start
    path (issue 13, bench/coldstart.py). The guard stays where it catches mistakes: the replay tests run
    every committed history with `sandbox_own_modules=True`, the workflow modules imported inside the
    sandbox with its restrictions."""
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    passthrough = ("pydantic", "opentelemetry") if sandbox_own_modules else ("pydantic", "opentelemetry", "llmgw")
    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*passthrough))


def tls_config(settings: Settings):
    """The client TLS of `settings` (see config.py, `temporal_tls*`): False for plain gRPC, else a
    `TLSConfig`. Files are read here, so a wrong path says which setting names it."""
    from temporalio.service import TLSConfig

    if not settings.temporal_tls_on:
        return False
    if bool(settings.temporal_tls_cert) != bool(settings.temporal_tls_key):
        raise SystemExit("Temporal mutual TLS needs both LLMGW_TEMPORAL_TLS_CERT and LLMGW_TEMPORAL_TLS_KEY "
                         "(the client certificate and its key, PEM)")

    def read(name: str, path):
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError as exc:
            raise SystemExit(f"cannot read LLMGW_{name.upper()} ({path}): {exc.strerror}") from None

    return TLSConfig(server_root_ca_cert=read("temporal_tls_ca", settings.temporal_tls_ca),
                     domain=settings.temporal_tls_server_name,
                     client_cert=read("temporal_tls_cert", settings.temporal_tls_cert),
                     client_private_key=read("temporal_tls_key", settings.temporal_tls_key))


def payload_codec(settings: Settings):
    """The codec that encrypts payloads when a payload key is set (security/payload_codec.py), else None. A
    key file that cannot be used stops the process, naming the setting."""
    from llmgw.security.payload_codec import EncryptionCodec, PayloadKeyError, load_keys

    path = settings.resolved_payload_key
    if path is None:
        return None
    try:
        return EncryptionCodec(load_keys(path), encrypt=settings.payload_encrypt)
    except PayloadKeyError as exc:
        raise SystemExit(f"LLMGW_PAYLOAD_KEY: {exc}") from None


def data_converter(settings: Settings) -> DataConverter:
    """`WIRE_CONVERTER`, with `payload_codec(settings)` when there is one."""
    import dataclasses

    codec = payload_codec(settings)
    return WIRE_CONVERTER if codec is None else dataclasses.replace(WIRE_CONVERTER, payload_codec=codec)


async def connect(settings: Settings, attempts: int = 60) -> Client:
    """Connect to `settings.resolved_temporal_address`, retrying for about `attempts` seconds."""
    from llmgw.telemetry import tracing_enabled

    address = settings.resolved_temporal_address
    interceptors = []
    if tracing_enabled():
        from temporalio.contrib.opentelemetry import TracingInterceptor

        # Spans travel in workflow/activity headers: one trace from a pass through the node's activities.
        interceptors.append(TracingInterceptor(always_create_workflow_spans=True))
    tls = tls_config(settings)
    converter = data_converter(settings)
    last: Exception | None = None
    for i in range(attempts):
        try:
            return await Client.connect(address, namespace=settings.temporal_namespace,
                                        data_converter=converter, interceptors=interceptors, identity=identity(),
                                        tls=tls, api_key=settings.temporal_api_key or None)
        except Exception as exc:  # noqa: BLE001 - RuntimeError from the core SDK on refused connections
            last = exc
            if i == 0:
                log.info("waiting for Temporal at %s", address)
            await asyncio.sleep(1)
    raise SystemExit(f"cannot reach Temporal at {address}: {last}; set LLMGW_TEMPORAL_ADDRESS or run `llmgw dev`")


async def wake_reconciler(client: Client | None, reason: str) -> bool:
    """Signal the reconciler to run a pass now. False (and logged) when it cannot be reached; the
    reconciler's own timer still runs, so a lost wake-up only delays a pass."""
    from llmgw.workflows.ids import RECONCILER_ID

    if client is None:
        return False
    try:
        await client.get_workflow_handle(RECONCILER_ID).signal("wake", reason)
        return True
    except Exception as exc:  # noqa: BLE001 - RPCError when the reconciler is not running yet
        log.warning("could not wake the reconciler (%s): %s", reason, exc)
        return False


WAKE_TIMEOUT_S = 5.0


class LazyClient:
    """A Temporal client connected in the background, so an HTTP server can start before Temporal."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.client: Client | None = None
        self._task: asyncio.Task | None = None
        self._wakes: set[asyncio.Task] = set()  # wake-ups under way (`wake_soon`), kept from the collector
        self._queued: str | None = None  # the first reason asked while one was under way (`wake_soon`)
        self._queued_more = 0  # and how many more
        self.attributes = SearchAttributeCheck(settings.temporal_namespace, settings.temporal_search_attributes)

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        while self.client is None:
            try:
                self.client = await connect(self.settings, attempts=5)
            except SystemExit as exc:
                log.warning("%s", exc)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()

    async def wake(self, reason: str) -> bool:
        return await wake_reconciler(self.client, reason)

    def wake_soon(self, reason: str, timeout_s: float = WAKE_TIMEOUT_S) -> None:
        """Wake the reconciler without waiting for it: for an answer that must not wait on Temporal (the
        node API's: with Temporal away, a signal is retried for about ten seconds, as long as a node waits
        for its registration, which it then retried for as long as the outage lasted).

        Wakes coalesce: while one signal is under way, those asked meanwhile are sent as one signal after it
        (the first reason and how many more). The reconciler runs one pass for any number of them, and a
        registration burst of thousands of nodes had sent thousands of signals at once, most of them timing
        out (issue 42, the fleet simulator). Each event is still followed by a signal sent after it."""
        if self._wakes:
            if self._queued is None:
                self._queued = reason
            else:
                self._queued_more += 1
            return
        task = asyncio.get_running_loop().create_task(asyncio.wait_for(self.wake(reason), timeout_s))
        self._wakes.add(task)
        task.add_done_callback(self._woken)

    def _woken(self, task: asyncio.Task) -> None:
        self._wakes.discard(task)
        if not task.cancelled() and isinstance(task.exception(), asyncio.TimeoutError):
            log.warning("could not wake the reconciler within %gs; its own timer runs the next pass", WAKE_TIMEOUT_S)
        if self._queued is not None and not self._wakes:
            reason, more = self._queued, self._queued_more
            self._queued, self._queued_more = None, 0
            self.wake_soon(reason if not more else f"{reason} (and {more} more)")


class SearchAttributeCheck:
    """Whether the namespace has llmgw's search attributes registered (`workflows/attributes.py`), asked
    by everything that starts workflows. A start naming an unregistered attribute is refused by the
    server, so without them workflows start without them, and this says so once, with the command that
    registers them. A yes is kept; a no is asked again after `recheck_s` (an operator may register them
    while llmgw runs). `enabled=False` (setting `temporal_search_attributes`) never uses them."""

    def __init__(self, namespace: str, enabled: bool = True, recheck_s: float = 60.0):
        self.namespace = namespace
        self.enabled = enabled
        self.recheck_s = recheck_s
        self._ok: bool | None = None
        self._checked_at = -1e18
        self._warned = False

    async def registered(self, client: Client | None) -> bool:
        if not self.enabled or client is None:
            return False
        loop = asyncio.get_running_loop()
        if self._ok or (self._ok is False and loop.time() - self._checked_at < self.recheck_s):
            return bool(self._ok)
        self._checked_at = loop.time()
        missing = await self._missing(client)
        self._ok = not missing
        if missing and not self._warned:
            self._warned = True
            from llmgw.workflows.attributes import REGISTRY

            cmds = "; ".join(f"temporal operator search-attribute create --namespace {self.namespace} --name {n} "
                             f"--type {REGISTRY[n]}" for n in missing if n in REGISTRY)
            log.warning("Temporal namespace %r lacks llmgw's search attributes (%s): workflows start without "
                        "them, so the Temporal UI cannot find them by model, node or replica. Register them "
                        "once: %s", self.namespace, ", ".join(missing), cmds or "(see docs/operating.md)")
        elif not missing and self._warned:
            log.info("Temporal namespace %r has llmgw's search attributes now; new workflows carry them", self.namespace)
        return self._ok

    async def _missing(self, client: Client) -> list[str]:
        """Names not registered with the type llmgw sets (all of them when the namespace cannot be asked)."""
        from temporalio.api.enums.v1 import IndexedValueType
        from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

        from llmgw.workflows.attributes import REGISTRY

        try:
            resp = await client.operator_service.list_search_attributes(
                ListSearchAttributesRequest(namespace=self.namespace))
        except Exception as exc:  # noqa: BLE001 - RPCError (permissions, an old server): start without them
            log.warning("cannot list the search attributes of Temporal namespace %r (%s)", self.namespace, exc)
            return list(REGISTRY)
        have = dict(resp.custom_attributes)
        want = {n: IndexedValueType.Value("INDEXED_VALUE_TYPE_" + ("KEYWORD_LIST" if t == "KeywordList" else t.upper()))
                for n, t in REGISTRY.items()}
        return [n for n, t in want.items() if have.get(n) != t]

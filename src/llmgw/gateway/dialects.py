"""The engine version each replica reports, read once, and so whether it gets Messages natively (issue 41).

The decision is `engines/dialects.py`'s table (`speaks_messages`); this reads what it decides from: the
replica's `PROBE` path (vLLM's and the sim's `GET /version`, llama-server's `GET /props`), on its first
Messages request, kept on its `Endpoint`; an answer that cannot be read is asked again after `RETRY_S`,
the request translated meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from llmgw.engines.dialects import MESSAGES_SINCE, PROBE, reported_version, speaks_messages
from llmgw.gateway.upstream import Upstream, UpstreamError

if TYPE_CHECKING:
    from llmgw.gateway.routes import Endpoint

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
RETRY_S = 30.0  # an engine whose version could not be read is asked again after this long
MAX_PROBE = 1 << 20  # a /props answer holds the chat template: bounded all the same


class Dialects:
    """Whether each endpoint's engine serves Messages natively, read once per replica and kept on it
    (`Endpoint.native`: None until known)."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._reading: dict[str, asyncio.Future] = {}

    async def native(self, ep: "Endpoint") -> bool:
        if ep.native is not None:
            return ep.native
        loop = asyncio.get_running_loop()
        path = PROBE.get(ep.engine)
        if path is None or ep.engine not in MESSAGES_SINCE:
            ep.native = False
            return False
        if ep.native_retry_at > loop.time():
            return False
        pending = self._reading.get(ep.replica_id)
        if pending is None:
            pending = self._reading[ep.replica_id] = asyncio.ensure_future(self._read(ep, path))
            pending.add_done_callback(lambda _: self._reading.pop(ep.replica_id, None))
        return await asyncio.shield(pending)

    async def _read(self, ep: "Endpoint", path: str) -> bool:
        try:
            resp = await asyncio.wait_for(self.upstream.get(ep.target, path), PROBE_TIMEOUT_S)
            try:
                answer = await asyncio.wait_for(resp.read(MAX_PROBE), PROBE_TIMEOUT_S)
                status = resp.status
            finally:
                resp.abort()
        except (UpstreamError, TimeoutError, OSError) as exc:
            log.info("%s: its engine's version could not be read (%s); Messages translated for now",
                     ep.replica_id, exc)
            ep.native_retry_at = asyncio.get_running_loop().time() + RETRY_S
            return False
        version = reported_version(ep.engine, answer) if status == 200 else None
        ep.native = speaks_messages(ep.engine, version)
        log.info("%s: %s %s; Messages %s", ep.replica_id, ep.engine,
                 ".".join(map(str, version)) if version else "of no known version",
                 "passed through" if ep.native else "translated to chat completions")
        return ep.native

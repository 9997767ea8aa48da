"""The engines' own queues, read by each gateway, as a saturation signal for its fair queues (issue 37).

A model's gate (gateway/admission.py) counts the slots this gateway lets through; the engines behind it
have bounds of their own (vLLM's `max_num_seqs`, llama-server's slots), and past them requests wait inside
the engine, first come first served, where no tenant's weight counts. So every `poll_s` (the setting
`engine_queue_poll_s`; 0: never) this reads, for each model whose gate learns (it has `max_queue`) and has
requests in flight, every Ready replica's waiting gauge from its engine's `/metrics` (engines/queue_gauges.py;
a static endpoint's by whichever of those gauges its page has)
and gives their sum to the gate (`Gate.engines_waiting`), which lowers its slots to what the engines run,
so the rest wait here and fair queuing picks who goes next; and grows them back while the engines queue
nothing. A replica whose page cannot be read within `READ_TIMEOUT_S` (or is over `MAX_PAGE` bytes, or
lacks the gauge) counts for nothing and is not asked again for `RETRY_S`; with none readable the slots are
left as they are.

Several gateways: an engine's queue holds every gateway's requests, so each lowers its slots by all of
them; together they still let through at least one request each, and grow back as the queues empty.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from llmgw.engines.queue_gauges import waiting
from llmgw.gateway.upstream import Upstream, UpstreamError

if TYPE_CHECKING:
    from llmgw.gateway.admission import Gates
    from llmgw.gateway.routes import Endpoint, RouteTable

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 2.0
RETRY_S = 60.0  # a replica whose queue could not be read is asked again after this long
MAX_PAGE = 4 << 20  # a vLLM metrics page with many models' histograms is some hundreds of KB


class EngineQueues:
    """Reads the engines' queues for the gates that learn from them (see the module docstring)."""

    def __init__(self, routes: "RouteTable", gates: "Gates", upstream: Upstream, poll_s: float):
        self.routes = routes
        self.gates = gates
        self.upstream = upstream
        self.poll_s = poll_s

    async def loop(self) -> None:
        if self.poll_s <= 0:
            return
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll()
            except Exception:  # a bug here must not end the loop: the gates keep their slots meanwhile
                log.exception("reading the engines' queues failed")

    async def poll(self) -> None:
        """One reading for every gate that learns and has requests in flight."""
        for name, gate in list(self.gates.gates.items()):
            route = self.routes.models.get(name)
            if not gate.learns or not gate.active or route is None:
                continue
            now = asyncio.get_running_loop().time()
            endpoints = [e for e in route.endpoints if e.queue_retry_at <= now]
            if not endpoints:
                continue
            counts = [n for n in await asyncio.gather(*map(self._waiting, endpoints)) if n is not None]
            if counts and self.gates.gates.get(name) is gate:
                before = gate.max_concurrency
                if gate.engines_waiting(sum(counts)):
                    log.debug("%s: its engines queue %d request(s); its slots on this gateway %d -> %d",
                             name, sum(counts), before, gate.max_concurrency)

    async def _waiting(self, ep: "Endpoint") -> int | None:
        n = await self._read(ep)
        if n is None:
            ep.queue_retry_at = asyncio.get_running_loop().time() + RETRY_S
        return n

    async def _read(self, ep: "Endpoint") -> int | None:
        try:
            resp = await asyncio.wait_for(self.upstream.get(ep.target, "/metrics"), READ_TIMEOUT_S)
            try:
                page = await asyncio.wait_for(resp.read_whole(MAX_PAGE), READ_TIMEOUT_S)
                ok = resp.status == 200
            except BaseException:
                resp.abort()
                raise
            resp.release()
        except (UpstreamError, TimeoutError, OSError) as exc:
            log.debug("%s: its engine's queue could not be read (%s)", ep.replica_id, exc)
            return None
        return waiting(ep.engine, page.decode("utf-8", "replace")) if ok else None

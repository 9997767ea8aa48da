"""`llmgw server`: the gateway (:8080), the admin API (127.0.0.1:8081) and the node API (:8443) in one process."""

from __future__ import annotations

import asyncio
import logging

from llmgw.config import Settings
from llmgw.db.engine import async_engine
from llmgw.db.migrate import upgrade
from llmgw.gateway.admin import create_admin_api
from llmgw.gateway.app import Gateway, create_gateway_app
from llmgw.gateway.fleet_service import FleetService
from llmgw.gateway.nodeapi import create_node_api
from llmgw.schemas.payloads import LivenessFacts
from llmgw.serving import TLS, Listener, install_stop_handlers, serve

log = logging.getLogger(__name__)


def main(settings: Settings, migrate: bool = True) -> None:
    """Run the server process on uvloop when it is installed: the measured difference on the relay's CPU
    time per request is about a quarter (bench/overhead.py)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it on Linux and macOS
        asyncio.run(run_server(settings, migrate=migrate))
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run_server(settings, migrate=migrate))


async def run_server(settings: Settings, migrate: bool = True) -> None:
    url = settings.require_database_url()
    if migrate:
        await asyncio.to_thread(upgrade, url)
    engine = async_engine(url, pool_size=10)
    gw = Gateway(settings, engine)
    fleet = FleetService(engine, gw.temporal)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    tls = None
    if settings.node_api_tls:
        tls = TLS(str(settings.node_api_cert), str(settings.node_api_key), str(settings.ca_cert))
    else:
        log.warning("the node API runs without mutual TLS: any client can claim to be any node. Configure "
                    "LLMGW_CA_CERT, LLMGW_NODE_API_CERT and LLMGW_NODE_API_KEY (llmgw ctl cert ...)")
    listeners = [
        Listener(create_gateway_app(gw), settings.host, settings.gateway_port, "gateway"),
        Listener(create_admin_api(engine, gw.temporal, settings.node_unreachable_after_s, settings.node_lost_after_s,
                                  LivenessFacts(poller_grace_s=settings.poller_grace_s, silent_share=settings.silent_share)),
                 settings.admin_host, settings.admin_port, "admin", lifespan="off"),
        Listener(create_node_api(fleet, require_identity=tls is not None), settings.host, settings.node_api_port,
                 "node-api", lifespan="off", tls=tls),
    ]
    log.info("gateway on %s:%d, admin on %s:%d, node API on %s:%d", settings.host, settings.gateway_port,
             settings.admin_host, settings.admin_port, settings.host, settings.node_api_port)
    observer = asyncio.create_task(fleet.observe_loop(min(settings.heartbeat_interval_s, 2.0),
                                                      settings.node_unreachable_after_s), name="observer")
    try:
        await serve(listeners, stop)
    finally:
        observer.cancel()
        await engine.dispose()

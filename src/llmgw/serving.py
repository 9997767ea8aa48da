"""Run several ASGI apps on their own listeners in one process, stopping all on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the process installs its own handlers for all listeners
        yield


@dataclass
class Listener:
    app: object
    host: str
    port: int
    name: str
    lifespan: str = "on"


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve(listeners: list[Listener], stop: asyncio.Event, log_level: str = "warning") -> None:
    """Serve every listener until `stop` is set or one of them fails."""
    servers = [
        _Server(uvicorn.Config(l.app, host=l.host, port=l.port, log_level=log_level, lifespan=l.lifespan,
                               access_log=False, timeout_graceful_shutdown=5, http="httptools"))
        for l in listeners
    ]
    tasks = [asyncio.create_task(s.serve(), name=l.name) for s, l in zip(servers, listeners)]
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    waiter.cancel()
    for t in done:
        if t is not waiter and t.exception():
            raise t.exception()  # type: ignore[misc]
    for s, l in zip(servers, listeners):
        if not s.started:
            raise SystemExit(f"{l.name} could not listen on {l.host}:{l.port}")

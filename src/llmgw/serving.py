"""Run several ASGI apps on their own listeners in one process, stopping all on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass

import ssl

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmgw.security.pki import cert_addresses, common_name


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the process installs its own handlers for all listeners
        yield


class TLSIdentityProtocol(HttpToolsProtocol):
    """HTTP/1.1 protocol that puts the verified client certificate's common name into the ASGI scope
    as the ASGI TLS extension (`scope["extensions"]["tls"]["client_cert_name"]`), which uvicorn does
    not fill in itself. The TLS handshake has already verified the chain against our CA. Beside it: the
    certificate's IP and DNS names and the connection's peer address, read from the socket (never from a
    forwarding header), which the node API checks reported endpoints against."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        ssl_object = self.transport.get_extra_info("ssl_object")
        cert = ssl_object.getpeercert() if ssl_object is not None else None
        ips, names = cert_addresses(cert)
        peer = self.transport.get_extra_info("peername")
        self.scope["extensions"] = {"tls": {"client_cert_name": common_name(cert), "client_cert_ips": ips,
                                            "client_cert_names": names, "peer_address": peer[0] if peer else None}}


@dataclass
class TLS:
    """Server TLS; with `ca_cert`, clients must present a certificate signed by it (mutual TLS)."""

    cert: str
    key: str
    ca_cert: str | None = None


@dataclass
class Listener:
    app: object
    host: str
    port: int
    name: str
    lifespan: str = "on"
    tls: TLS | None = None


def install_stop_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve(listeners: list[Listener], stop: asyncio.Event, log_level: str = "warning") -> None:
    """Serve every listener until `stop` is set or one of them fails."""
    servers = [_Server(_config(lst, log_level)) for lst in listeners]
    tasks = [asyncio.create_task(s.serve(), name=lst.name) for s, lst in zip(servers, listeners)]
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    waiter.cancel()
    for t in done:
        if t is not waiter and t.exception():
            raise t.exception()  # type: ignore[misc]
    for s, lst in zip(servers, listeners):
        if not s.started:
            raise SystemExit(f"{lst.name} could not listen on {lst.host}:{lst.port}")


def _config(listener: Listener, log_level: str) -> uvicorn.Config:
    kw: dict = dict(host=listener.host, port=listener.port, log_level=log_level, lifespan=listener.lifespan,
                    access_log=False, timeout_graceful_shutdown=5, http="httptools")
    tls = listener.tls
    if tls is not None:
        kw.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        if tls.ca_cert:
            kw.update(ssl_ca_certs=tls.ca_cert, ssl_cert_reqs=ssl.CERT_REQUIRED, http=TLSIdentityProtocol)
    return uvicorn.Config(listener.app, **kw)

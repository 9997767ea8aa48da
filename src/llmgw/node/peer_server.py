"""A node's peer listener (issue 39): its weight cache, served to other nodes over mutual TLS.

A node starting a replica whose weights another node already holds fetches them from that node instead of
the mirror (weights/fetcher.py), when the control plane names it in its answer to "still wanted?"
(`LaunchCheckResponse.peers`). This is the listener it fetches from:
- the mirror's byte listener (weights/files_app.py) over the cache directory: `GET /files/<cache name>` (Range
  supported, the sha256 recorded at fetch time in `X-Llmgw-Sha256`) and `GET /files/<cache name>/` (a
  version's manifest, from the directory, whole or refused). Hidden entries (`.partial`, records, locks,
  compile caches) are never listed or served, and a name that escapes the cache is refused;
- mutual TLS only: the client must present a certificate from llmgw's CA (any node's), and this node
  presents its own node certificate, whose common name the client checks against the node it was told of.
  Certificates issued before peer fetch carry clientAuth alone, which a TLS client refuses for a server:
  such a node listens but advertises nothing until its certificate is renewed (`pki.serves_peers`);
- on `advertise_host` (what engines listen on), port `peer_port` (0: a free one, chosen at start); the URL
  goes in the node's inventory, and the node API pins its host to the node's own addresses as it does an
  engine endpoint (security/node_address.py);
- a renewed certificate is loaded into the listener's TLS context for the connections after it.

What the fetching node trusts is not the peer's digest but the mirror's: see weights/fetcher.py. The deny-list
of revoked certificates lives in Postgres, which nodes do not read: a revoked node's certificate is refused
by the node API at once, by peers only when it runs out (`node_cert_days`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from pathlib import Path

from llmgw.http.serving import TLS, Listener, listener_limits, make_server
from llmgw.security.pki import load_cert, serves_peers
from llmgw.weights.files_app import create_files_app

log = logging.getLogger(__name__)


class PeerListener:
    """Serves `cache_dir` to peers on (`host`, `port`) with the node's certificate; `url` once listening."""

    def __init__(self, settings, cache_dir: Path):
        self.settings = settings
        self.cache_dir = cache_dir
        self.url: str | None = None  # what the inventory advertises (None: nothing)
        self._server = None
        self._sock: socket.socket | None = None

    @staticmethod
    def wanted(settings) -> str | None:
        """Why this node serves no peers (None: it does)."""
        s = settings
        if s.peer_port < 0:
            return "LLMGW_PEER_PORT is -1"
        if not (s.ca_cert and s.node_cert and s.node_key):
            return "it has no node certificate (peers are served over mutual TLS only)"
        return None

    def advertisable(self) -> str | None:
        """The URL to advertise now, or None while this node's certificate cannot serve TLS."""
        if self.url is None:
            return None
        try:
            return self.url if serves_peers(load_cert(self.settings.node_cert)) else None
        except (OSError, ValueError):
            return None

    def bind(self) -> bool:
        """Listen (not yet serve); False when the address cannot be had (logged)."""
        host = self.settings.advertise_host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.settings.peer_port))
        except OSError as exc:
            # Not a reason to stop the agent and its engines: other nodes fetch from the mirror instead.
            sock.close()
            log.error("the peer listener cannot listen on %s:%s (%s); this node serves no peers: set "
                      "LLMGW_PEER_PORT to a free port, 0 for any, or -1 to serve none", host, self.settings.peer_port,
                      exc.strerror)
            return False
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        port = sock.getsockname()[1]
        self.url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        s = self.settings
        listener = Listener(create_files_app(self.cache_dir), host, port, "peer", lifespan="off",
                            tls=TLS(str(s.node_cert), str(s.node_key), str(s.ca_cert)),
                            limits=listener_limits(s, 64 << 10))
        self._server = make_server(listener)
        if not serves_peers(load_cert(s.node_cert)):
            log.warning("this node's certificate %s predates peer fetch (clientAuth only): it serves no peers "
                        "until it is renewed", s.node_cert)
        return True

    async def run(self) -> None:
        assert self._server is not None and self._sock is not None
        log.info("serving the weight cache %s to peers on %s", self.cache_dir, self.url)
        try:
            await self._server.serve(sockets=[self._sock])
            why = "it stopped"
        except Exception as exc:  # noqa: BLE001 - the node runs on without it
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self._sock.close()
        if not self._server.should_exit:
            # Not a reason to stop the agent and its engines: peers fetch from the mirror instead.
            log.error("the peer listener on %s ended (%s); this node serves no peers until it restarts", self.url, why)
            self.url = None
            await asyncio.Event().wait()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    def reload(self) -> None:
        """Present the certificate now on disk (just renewed) to the next connections."""
        ctx: ssl.SSLContext | None = getattr(self._server.config, "ssl", None) if self._server else None
        if ctx is not None:
            ctx.load_cert_chain(str(self.settings.node_cert), str(self.settings.node_key))


def client_context(settings) -> ssl.SSLContext:
    """TLS to peers: llmgw's CA alone trusted, this node's certificate presented; no host name checked (the
    peer's common name is, against the node the control plane named: weights/http.py `PeerTLS`)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(settings.ca_cert))
    ctx.load_cert_chain(str(settings.node_cert), str(settings.node_key))
    return ctx


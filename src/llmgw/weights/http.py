"""The HTTP client weight fetches use: blocking, one connection per request, run in a thread.

Why not the event loop's client: a weights body is a few large files, and what it costs is CPU per byte.
Reading in a thread that releases the GIL while it receives, writes and hashes costs about half the CPU of
an asyncio stream reader (bench/fetch.py), and a dropped connection loses nothing that was received
(nothing sits in a library's buffer when the error comes).

Where it connects: the host is resolved once, every address is checked against the `AddressPolicy` when
there is one, and the connection goes to exactly those addresses (TLS still verifies the host name), so a
name cannot resolve to one address when checked and another when connected (DNS rebinding). Redirects are
followed by hand, each hop checked (`urls.py`). Bodies are asked for as sent (`Accept-Encoding: identity`).

A peer node's cache (issue 39, node/peer_server.py) is reached with `PeerTLS`: llmgw's CA alone trusted,
this node's certificate presented, and the answering certificate must name the peer the control plane
named (its common name): the node id is the identity, whatever address the URL holds.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from llmgw.security.pki import common_name
from llmgw.weights.urls import MAX_REDIRECTS, REDIRECTS, AddressPolicy, URLRefused, check_url, redact

_TLS = None


def _tls() -> ssl.SSLContext:
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS


@dataclass(frozen=True)
class PeerTLS:
    """TLS to one peer node: `context` trusts llmgw's CA only and presents this node's certificate (checking
    no host name: the peer is named by `node_id`, which its certificate's common name must equal)."""

    context: ssl.SSLContext
    node_id: str


class PeerRefused(OSError):
    """The peer's certificate, though the CA signed it, names another node."""


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to addresses resolved (and checked) beforehand."""

    def __init__(self, host: str, port: int, addresses: list[str], timeout: float, peer: PeerTLS | None = None):
        super().__init__(host, port, timeout=timeout)
        self._addresses = addresses
        self._peer = peer

    def _open(self) -> socket.socket:
        last: OSError | None = None
        for a in self._addresses:
            try:
                sock = socket.create_connection((a, self.port), self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as exc:
                last = exc
        raise last or OSError(f"{self.host}: no address")

    def connect(self) -> None:
        self.sock = self._open()


class _PinnedTLS(_Pinned):
    default_port = 443

    def connect(self) -> None:
        if self._peer is None:
            self.sock = _tls().wrap_socket(self._open(), server_hostname=self.host)
            return
        sock = self._peer.context.wrap_socket(self._open(), server_hostname=None)
        named = common_name(sock.getpeercert())
        if named != self._peer.node_id:
            sock.close()
            raise PeerRefused(f"the peer at {self.host}:{self.port} presented the certificate of {named!r}, "
                              f"not of {self._peer.node_id}")
        self.sock = sock


def resolve(host: str, port: int, policy: AddressPolicy | None) -> list[str]:
    """Every address `host` resolves to (numeric spellings such as `127.1` included), checked against
    `policy` when given. Raises `URLRefused`, or `OSError` when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if policy is not None:
            raise URLRefused(f"{host}: cannot be resolved ({exc.strerror})") from None
        raise OSError(f"{host}: cannot be resolved ({exc.strerror})") from None
    except (UnicodeError, ValueError):  # `a..b`, a label over 63 characters: IDNA refuses to encode it
        raise URLRefused(f"{host[:100]!r} is not a host name (an empty or over-long label)") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if policy is not None:
        policy.check_addresses(host, addresses)
    return addresses


@dataclass
class Opened:
    """A response at the end of its redirects (its headers read, its body not), the connection it came on,
    and the headers of the redirects on the way (a CDN redirect may carry the file's checksum)."""

    response: http.client.HTTPResponse
    conn: http.client.HTTPConnection
    url: str
    hop_headers: list = field(default_factory=list)

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def headers(self):
        return self.response.headers

    def settimeout(self, seconds: float) -> None:
        if self.conn.sock is not None:
            self.conn.sock.settimeout(seconds)

    def readinto1(self, view: memoryview) -> int:
        """Read what one receive gives (at most `len(view)` bytes, never past the body's announced length)
        into `view`; 0 at the end of the body. Straight into the caller's buffer when the body is not
        chunked (no bytes object made and copied per read); through `read1` when it is."""
        r = self.response
        if r.chunked or r.fp is None:
            piece = r.read1(len(view))
            view[:len(piece)] = piece
            return len(piece)
        if r.length is not None:
            view = view[:r.length]
            if not view:
                return 0
        n = r.fp.readinto1(view)
        if r.length is not None:
            r.length -= n
        return n

    def close(self) -> None:
        self.conn.close()


def abort(conn: http.client.HTTPConnection | None) -> None:
    """From another thread: make a read blocked on `conn` return at once."""
    sock = conn.sock if conn is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def open_url(url: str, policy: AddressPolicy | None, headers: dict[str, str] | None = None, *,
             timeout_s: float = 60.0, max_redirects: int = MAX_REDIRECTS, on_conn=None,
             peer: PeerTLS | None = None, method: str = "GET") -> Opened:
    """GET (or `method`) `url` (blocking), following redirects: http(s) only, never https to http, at most
    `max_redirects`, every host through the policy. `timeout_s` bounds connecting and each read until the
    caller sets another, and the whole of each answer's status line and headers (a server dripping them a
    byte a second is cut off: `socket.timeout`). `on_conn(conn)` learns each connection as it opens (to
    `abort` it from elsewhere). `peer`: the URL is a peer node's listener (https only, no redirects followed).
Raises `URLRefused`; network errors are `OSError`/`http.client.HTTPException`."""
    hops: list = []
    current = url
    for _ in range(max_redirects + 1):
        scheme, host, port = check_url(current)
        addresses = resolve(host, port, policy)
        if peer is not None and scheme != "https":
            raise URLRefused(f"{redact(current)}: a peer node is reached over https only")
        conn = _PinnedTLS(host, port, addresses, timeout_s, peer) if scheme == "https" else \
            _Pinned(host, port, addresses, timeout_s)
        p = urlsplit(current)
        target = (p.path or "/") + (f"?{p.query}" if p.query else "")
        opened = None
        late = threading.Event()

        def too_late(conn=conn) -> None:
            late.set()
            abort(conn)

        timer = threading.Timer(timeout_s, too_late)
        timer.daemon = True
        try:
            conn.connect()
            if on_conn is not None:
                on_conn(conn)
            timer.start()
            conn.putrequest(method, target, skip_accept_encoding=True)
            for k, v in {"Accept-Encoding": "identity", "User-Agent": "llmgw", **(headers or {})}.items():
                conn.putheader(k, v)
            conn.endheaders()
            try:
                r = conn.getresponse()
            except (OSError, http.client.HTTPException):
                if late.is_set():
                    raise socket.timeout(f"no status line and headers within {timeout_s:g}s") from None
                raise
            opened = Opened(r, conn, current, hops)
        finally:
            timer.cancel()
            if opened is None:
                conn.close()
        if r.status in REDIRECTS and r.getheader("Location") and peer is None:
            hops.append(r.headers)
            nxt = urljoin(current, r.getheader("Location"))
            conn.close()
            if scheme == "https" and urlsplit(nxt).scheme == "http":
                raise URLRefused(f"{redact(current)} redirects from https to plain http ({redact(nxt)}); refused")
            current = nxt
            continue
        return opened
    raise URLRefused(f"{redact(url)}: more than {max_redirects} redirects")


def read_small(opened: Opened, cap: int) -> bytes:
    """The whole body, refusing more than `cap` bytes. Raises `ValueError` past the cap."""
    out = bytearray()
    while True:
        block = opened.response.read(min(1 << 16, cap + 1 - len(out)))
        if not block:
            return bytes(out)
        out += block
        if len(out) > cap:
            raise ValueError(f"more than {cap} bytes")

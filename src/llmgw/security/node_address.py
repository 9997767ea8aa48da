"""A node's own addresses, and whether an engine endpoint it reports is at one of them (issue 11).

The gateway proxies clients to the endpoints nodes report. A node may only report engines on itself, so an
endpoint's host must be one of the node's own addresses:
- the address its node-API connection comes from (the TCP peer, read from the connection itself, never
  from a forwarding header), and
- the addresses named in its client certificate (IP and DNS subject alternative names: `llmgw ctl cert node
  NODE_ID --address 10.0.0.5`), for a node that reaches the control plane from another address than the
  one its engines listen on (a management network, NAT).
A name in an endpoint is accepted when the certificate names it, or when it resolves to one of those
addresses.

The name is resolved once, here, and never again (issue 36): what is stored, and what the gateway connects
to, is the endpoint with its host replaced by the address verified now (`Pinned.endpoint`; the port and
path kept). Were the name kept, the gateway would resolve it on every connection, and a node that controls
the name could point prompts at any host after its report was checked. A name the certificate names is
pinned to the address it resolves to now (one of the node's own when it has one there).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

RESOLVE_TIMEOUT_S = 2.0


class AddressUnknown(Exception):
    """An endpoint's name could not be resolved now (a timeout, a resolver that failed or is away): neither
    this node's address nor another's. Whoever asked must not act on it as a refusal (a refusal stops the
    engine and fences its replica for good); it asks again later."""


@dataclass(frozen=True)
class NodeAddresses:
    """What the node API knows of where a request came from."""

    peer: str | None  # the TCP peer's IP address
    cert_ips: tuple[str, ...] = ()
    cert_names: tuple[str, ...] = ()
    ips: frozenset = field(init=False)

    def __post_init__(self) -> None:
        ips = set()
        for a in (self.peer, *self.cert_ips):
            ip = _ip(a)
            if ip is not None:
                ips.add(ip)
        object.__setattr__(self, "ips", frozenset(ips))

    def describe(self) -> str:
        named = [*self.cert_ips, *self.cert_names]
        out = f"its node-API connection comes from {self.peer or 'an unknown address'}"
        return out + (f" and its certificate names {', '.join(named)}" if named else "")


def _ip(text: str | None):
    """`text` as an IP address (IPv4-mapped IPv6 read as IPv4, zone and brackets dropped), or None."""
    if not text:
        return None
    try:
        ip = ipaddress.ip_address(text.strip().strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class Pinned:
    """An endpoint checked: `endpoint` is it with its host replaced by the verified IP address (None when
    refused), `refusal` why it is not the node's (None when accepted)."""

    endpoint: str | None
    refusal: str | None = None


async def _resolve(host: str) -> list:
    """`host`'s addresses (`_ip` form, in the resolver's order); [] for a name that does not exist. Raises
    `AddressUnknown` when it cannot be resolved now."""
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
                                       RESOLVE_TIMEOUT_S)
    except socket.gaierror as exc:
        if exc.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise AddressUnknown(f"endpoint host {host} cannot be resolved now ({exc})") from None
        return []  # the name does not exist: not this node's
    except (OSError, asyncio.TimeoutError) as exc:
        raise AddressUnknown(f"endpoint host {host} cannot be resolved now ({type(exc).__name__})") from None
    return [ip for ip in (_ip(i[4][0]) for i in infos) if ip is not None]


def _with_host(endpoint: str, ip) -> str:
    """`endpoint` with its host replaced by `ip` (IPv6 in brackets), its scheme, port and path kept."""
    parts = urlsplit(endpoint)
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


async def pin_endpoint(endpoint: str, node: NodeAddresses) -> Pinned:
    """Check that `endpoint` is on the node that reports it (its host one of the node's own addresses, or a
    name its certificate names or that resolves to one of them) and pin it to the verified address.
    Unparseable endpoints are refused too. Raises `AddressUnknown` when its name cannot be resolved now
    (a name that does not exist is refused)."""
    try:
        parts = urlsplit(endpoint)
        host, _ = parts.hostname, parts.port  # a port that is not a number raises here
    except ValueError:
        host = None
    if not host:
        return Pinned(None, f"endpoint {endpoint!r} names no host")
    ip = _ip(host)
    if ip is not None:
        if ip in node.ips:
            return Pinned(_with_host(endpoint, ip))
    else:
        addresses = await _resolve(host)
        own = [a for a in addresses if a in node.ips]
        if own:
            return Pinned(_with_host(endpoint, own[0]))
        if host.lower().rstrip(".") in {n.lower().rstrip(".") for n in node.cert_names}:
            if addresses:  # the CA vouched for the name: pinned to its address now
                return Pinned(_with_host(endpoint, addresses[0]))
            return Pinned(None, f"endpoint host {host}, which the node's certificate names, does not resolve")
    return Pinned(None, f"endpoint host {host} is not this node's address ({node.describe()}); an engine must "
                  "listen on the node that reports it: set LLMGW_ADVERTISE_HOST to the address the control plane "
                  "sees, or name the address in the node's certificate (llmgw ctl cert node NODE_ID --address ADDR)")

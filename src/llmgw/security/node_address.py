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
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

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


async def endpoint_not_own(endpoint: str, node: NodeAddresses) -> str | None:
    """Why `endpoint` is not on the node that reports it, or None when its host is one of the node's own
    addresses. Unparseable endpoints are refused too. Raises `AddressUnknown` when its name cannot be
    resolved now (a name that does not exist is refused)."""
    try:
        host = urlsplit(endpoint).hostname
    except ValueError:
        host = None
    if not host:
        return f"endpoint {endpoint!r} names no host"
    ip = _ip(host)
    if ip is not None:
        if ip in node.ips:
            return None
    elif host.lower().rstrip(".") in {n.lower().rstrip(".") for n in node.cert_names}:
        return None
    else:
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
                                           RESOLVE_TIMEOUT_S)
        except socket.gaierror as exc:
            if exc.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                raise AddressUnknown(f"endpoint host {host} cannot be resolved now ({exc})") from None
            infos = []  # the name does not exist: not this node's
        except (OSError, asyncio.TimeoutError) as exc:
            raise AddressUnknown(f"endpoint host {host} cannot be resolved now ({type(exc).__name__})") from None
        if any(_ip(i[4][0]) in node.ips for i in infos):
            return None
    return (f"endpoint host {host} is not this node's address ({node.describe()}); an engine must listen on the "
            "node that reports it: set LLMGW_ADVERTISE_HOST to the address the control plane sees, or name the "
            "address in the node's certificate (llmgw ctl cert node NODE_ID --address ADDR)")

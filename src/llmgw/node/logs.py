"""Reading an engine's log on its node, for `llmgw ctl logs` (through the `read_shard_log` activity).

Each shard's engine writes stdout and stderr to `<log_dir>/<shard_id>.log` (node/supervisor.py). The
shard id comes from the control plane, so it is checked before it names a file: only the characters
shard ids are made of, and the path must stay in the log directory.
"""

from __future__ import annotations

import codecs
import re
from pathlib import Path

from llmgw.schemas.payloads import ReadShardLogInput, ReadShardLogResult

SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,126}-r[0-9]{1,4}$")


class BadShardId(ValueError):
    pass


def log_path(log_dir: Path, shard_id: str) -> Path:
    """`<log_dir>/<shard_id>.log`, for a well-formed shard id only."""
    if not SHARD_ID.match(shard_id) or ".." in shard_id:
        raise BadShardId(f"{shard_id[:80]!r} is not a shard id (<replica id>-r<rank>)")
    path = log_dir / f"{shard_id}.log"
    if path.resolve().parent != log_dir.resolve():
        raise BadShardId(f"{shard_id[:80]!r} does not name a log in the log directory")
    return path


def read_log(log_dir: Path, node_id: str, inp: ReadShardLogInput) -> ReadShardLogResult:
    """Up to `inp.limit` bytes of the shard's log: its tail (offset < 0) or from `inp.offset`. A log that
    shrank below the offset (rotated, truncated) is read again from its start. The bytes returned end on
    a whole UTF-8 character; `offset` in the result is where the next read starts."""
    out = ReadShardLogResult(shard_id=inp.shard_id, node_id=node_id)
    path = log_path(log_dir, inp.shard_id)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return out
    with f:
        size = f.seek(0, 2)
        start = max(0, size - inp.limit) if inp.offset < 0 else (inp.offset if inp.offset <= size else 0)
        f.seek(start)
        raw = f.read(min(inp.limit, size - start))
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = dec.decode(raw, final=False)
    pending = len(dec.getstate()[0])  # an incomplete character at the end: left for the next read
    out.found, out.size, out.data, out.offset = True, size, text, start + len(raw) - pending
    return out

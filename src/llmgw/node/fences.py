"""Fences: the replicas this node has been told to stop, kept on disk (issue 9, "a stopped replica never
launches").

A stop command carries the replica's fencing generation (bumped by the control plane on every step towards
stopping); the node records it here before it stops anything. A fetch or launch for that replica carries the
generation its start read before deciding to launch, which is always lower, so the node refuses it: a late
retry, or a start that missed its cancellation, cannot put an engine on GPUs placement has handed to someone
else. Files survive an agent restart (`<shard_dir>/<node>/fences/<replica_id>`). A stop from code that
carried no generation fences every launch of the replica (replica ids are never reused).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)
FENCE_ALL = 2**31 - 1
KEEP_S = 7 * 86400.0  # far longer than any start could still be retrying a launch
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Fences:
    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, replica_id: str) -> Path:
        name = replica_id if _SAFE.match(replica_id) else "h-" + hashlib.sha256(replica_id.encode()).hexdigest()[:40]
        return self.dir / name

    def get(self, replica_id: str) -> int | None:
        try:
            return int(self._path(replica_id).read_text().strip())
        except (OSError, ValueError):
            return None

    def record(self, replica_id: str, generation: int) -> int:
        """Fence `replica_id` at `generation` (0: every launch). Never lowers a fence. Returns the fence."""
        gen = max(generation or FENCE_ALL, self.get(replica_id) or 0)
        path = self._path(replica_id)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(gen))
        os.replace(tmp, path)
        return gen

    def record_before_stopping(self, replica_id: str, generation: int, shard_id: str) -> OSError | None:
        """`record`, for a stop that goes on whatever happens: a fence that cannot be written (a full disk)
        must not keep the engine running. Returns the error (logged) instead of raising it."""
        try:
            self.record(replica_id, generation)
            return None
        except OSError as exc:
            log.error("could not record the fence of replica %s (%s); stopping shard %s anyway", replica_id, exc,
                      shard_id)
            return exc

    def refuses(self, replica_id: str, generation: int) -> int | None:
        """The fence that refuses a fetch or launch of `replica_id` at `generation`, or None when allowed."""
        fence = self.get(replica_id)
        return fence if fence is not None and generation < fence else None

    def prune(self, keep_s: float = KEEP_S) -> int:
        """Forget fences older than `keep_s`. Returns how many."""
        cutoff, n = time.time() - keep_s, 0
        for p in self.dir.iterdir():
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
                    n += 1
            except OSError:
                pass
        return n

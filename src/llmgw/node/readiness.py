"""When to check whether a starting engine is ready (issue 13: readiness detected as it happens).

Engines send no "ready" event, but each says what it has done as it does it: uvicorn's "Application
startup complete" (vLLM, SGLang), llama-server's "server is listening" and "model loaded", the sim engine's
"serving". So the engine's output is the cue: while a start is waited on, the shard's log size is looked at
every `TICK_S` (one `stat`), and the engine is asked (an HTTP check) as soon as its output grows; between
cues it is asked on a backoff from 10 ms to 250 ms, for an engine that becomes ready without a word.

A polled readiness check on a backoff alone found a quick engine up to half a pause late (the backoff's
steps 10, 30, 70, 150, 310, 560 ms after launch: an engine ready at 350 ms was seen at 560 ms); with the
cue it is seen within a tick of its line. During minutes of weight loading the cue costs 100 `stat`s a
second and at most one check per tick.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

TICK_S = 0.01
FIRST_PAUSE_S = 0.01
MAX_PAUSE_S = 0.25


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


class ReadinessCues:
    """`await cues.next()` returns when the engine should be checked again: its output grew, or the backoff
    pause since the last check has passed. `checked_on_output` counts checks the output prompted."""

    def __init__(self, log_path: Path, tick_s: float = TICK_S, first_pause_s: float = FIRST_PAUSE_S,
                 max_pause_s: float = MAX_PAUSE_S):
        self.log_path = log_path
        self.tick_s = tick_s
        self.pause_s = first_pause_s
        self.max_pause_s = max_pause_s
        self.seen = _size(log_path)
        self.checked_on_output = 0

    async def next(self) -> None:
        due = time.monotonic() + self.pause_s
        self.pause_s = min(self.max_pause_s, self.pause_s * 2)
        while True:
            await asyncio.sleep(min(self.tick_s, max(0.0, due - time.monotonic())))
            size = _size(self.log_path)
            if size != self.seen:
                self.seen = size
                self.checked_on_output += 1
                return
            if time.monotonic() >= due:
                return

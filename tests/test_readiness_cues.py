"""The node checks a starting engine's readiness as soon as the engine's output grows (node/readiness.py),
not only on its backoff."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from llmgw.node.readiness import ReadinessCues


def test_output_from_the_engine_prompts_a_check_long_before_the_backoff(tmp_path):
    log = tmp_path / "shard.log"
    log.write_bytes(b"starting\n")

    async def go() -> float:
        cues = ReadinessCues(log, first_pause_s=30.0)  # the backoff alone would wait 30 s
        # A real process writes its line after 0.2 s, as an engine says "serving" when it binds its port.
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2); print('serving', flush=True)"],
                                    stdout=out)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(cues.next(), timeout=10)
        finally:
            proc.wait()
        assert cues.checked_on_output == 1
        return time.monotonic() - t0

    assert asyncio.run(go()) < 10


def test_without_output_the_backoff_paces_checks(tmp_path):
    log = tmp_path / "shard.log"
    log.write_bytes(b"")

    async def go() -> list[float]:
        cues = ReadinessCues(log, first_pause_s=0.05, max_pause_s=0.2)
        gaps = []
        for _ in range(4):
            t0 = time.monotonic()
            await cues.next()
            gaps.append(time.monotonic() - t0)
        assert cues.checked_on_output == 0
        return gaps

    gaps = asyncio.run(go())
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2 and gaps[3] >= 0.2  # doubling, capped


def test_a_missing_log_is_not_output(tmp_path):
    async def go() -> None:
        cues = ReadinessCues(tmp_path / "absent.log", first_pause_s=0.02)
        await cues.next()
        assert cues.checked_on_output == 0

    asyncio.run(go())

"""Reading one gauge out of an engine's Prometheus text exposition (for in-flight counts while draining)."""

from __future__ import annotations

import re

import aiohttp


def gauge_sum(text: str, name: str) -> float | None:
    """Sum of every sample of metric `name` (any labels) in Prometheus text format; None when absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([-+0-9.eEinfNa]+)\s*$", re.M)
    values = [float(m.group(1)) for m in pattern.finditer(text)]
    return sum(values) if values else None


async def scrape_gauge(session: aiohttp.ClientSession, endpoint: str, name: str,
                       headers: dict[str, str] | None = None) -> int | None:
    """GET `endpoint`/metrics and return the sum of gauge `name` as an int; None when it cannot say."""
    try:
        async with session.get(endpoint + "/metrics", headers=headers or {},
                               timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status != 200:
                return None
            n = gauge_sum(await r.text(), name)
            return None if n is None else int(n)
    except (aiohttp.ClientError, TimeoutError):
        return None

"""Reading one gauge out of an engine's Prometheus text exposition (for in-flight counts while draining)."""

from __future__ import annotations

import re


def gauge_sum(text: str, name: str) -> float | None:
    """Sum of every sample of metric `name` (any labels) in Prometheus text format; None when absent."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([-+0-9.eEinfNa]+)\s*$", re.M)
    values = [float(m.group(1)) for m in pattern.finditer(text)]
    return sum(values) if values else None

"""InfiniBand discovery from sysfs, checked against the adapters the operator declared.

Fabric membership has to be configuration (OpenSM's default subnet prefix is the same on every fabric, so
a matching prefix proves nothing), but it is not taken on trust (seeds 001, "Stop trusting hardware
facts that were never checked"):
- a declared adapter (HCA) that is not on the node is not advertised: NCCL_IB_HCA would name a device
  that does not exist;
- an adapter with no ACTIVE port is not advertised: a port in INIT (linked, no subnet manager) carries
  no data and hangs the first all-reduce;
- a fabric's rate is its slowest active link, since a collective runs at the speed of its slowest.
Reasons are returned (and logged by the agent) on the machine that knows them.

sysfs layout: `<root>/<hca>/ports/<n>/state` ("4: ACTIVE") and `.../rate` ("200 Gb/sec (4X HDR)").
"""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.schemas.inventory import Fabric

SYSFS_ROOT = Path("/sys/class/infiniband")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def parse_rate(text: str) -> float:
    """Gb/s from a sysfs rate string such as "200 Gb/sec (4X HDR)"; 0 when unreadable."""
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else 0.0


def port_states(hca_dir: Path) -> dict[str, tuple[str, float]]:
    """port number -> (state name, rate in Gb/s) for one adapter."""
    out = {}
    ports = hca_dir / "ports"
    if not ports.is_dir():
        return out
    for p in sorted(ports.iterdir(), key=lambda p: p.name):
        state = _read(p / "state")
        out[p.name] = (state.split(":", 1)[-1].strip() if state else "UNKNOWN", parse_rate(_read(p / "rate")))
    return out


def discover_fabrics(declared: dict[str, list[str]], root: Path = SYSFS_ROOT) -> tuple[list[Fabric], list[str]]:
    """Fabrics this node can really use, and one note per declared adapter or fabric left out (with why).

    `declared` maps fabric name -> adapter names from agent.yaml, e.g. {"ib-a": ["mlx5_0", "mlx5_1"]}.
    """
    fabrics: list[Fabric] = []
    notes: list[str] = []
    for name, adapters in sorted(declared.items()):
        usable: list[str] = []
        rates: list[float] = []
        for hca in adapters:
            hca_dir = root / hca
            if not hca_dir.is_dir():
                present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
                notes.append(f"fabric {name}: adapter {hca} is declared but not on this node "
                             f"(present: {', '.join(present) or 'none'}); not advertised")
                continue
            states = port_states(hca_dir)
            active = [rate for state, rate in states.values() if state == "ACTIVE"]
            if not active:
                seen = ", ".join(f"port {n} {s}" for n, (s, _) in states.items()) or "no ports"
                notes.append(f"fabric {name}: adapter {hca} has no ACTIVE port ({seen}); not advertised")
                continue
            usable.append(hca)
            rates.append(min(active))
        if usable:
            fabrics.append(Fabric(name=name, adapters=usable, rate_gbps=min(rates)))
        else:
            notes.append(f"fabric {name}: no usable adapter; this node does not advertise it")
    return fabrics, notes

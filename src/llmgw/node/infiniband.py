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

from llmgw.schemas.inventory import HCA, Fabric, HCAPort
from llmgw.node.fabric import advertise_fabrics

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


def read_ports(hca_dir: Path) -> list[HCAPort]:
    """The ports of one adapter with their state name (`ACTIVE`, `INIT`, ...) and rate in Gb/s."""
    ports = hca_dir / "ports"
    if not ports.is_dir():
        return []
    out = []
    for p in sorted(ports.iterdir(), key=lambda p: p.name):
        state = _read(p / "state")
        out.append(HCAPort(number=int(p.name) if p.name.isdigit() else 0,
                           state=state.split(":", 1)[-1].strip() if state else "UNKNOWN",
                           rate_gbps=parse_rate(_read(p / "rate"))))
    return out


def read_hcas(declared: dict[str, list[str]], root: Path = SYSFS_ROOT) -> tuple[list[HCA], list[str]]:
    """The declared adapters that exist in sysfs, with their ports; a note for each one that does not."""
    hcas: list[HCA] = []
    notes: list[str] = []
    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    for fabric, adapters in sorted(declared.items()):
        found = 0
        for name in adapters:
            if name not in present:
                notes.append(f"adapter {name} on fabric {fabric} is declared but not on this node "
                             f"(present: {', '.join(present) or 'none'}); not advertised")
                continue
            hcas.append(HCA(name=name, fabric=fabric, ports=read_ports(root / name)))
            found += 1
        if not found:
            notes.append(f"fabric {fabric} is not advertised: none of its declared adapters is on this node")
    return hcas, notes


def discover_fabrics(declared: dict[str, list[str]], root: Path = SYSFS_ROOT) -> tuple[list[Fabric], list[str]]:
    """Fabrics this node can really use, and one note per declared adapter or fabric left out (with why).

    `declared` maps fabric name -> adapter names from agent.yaml, e.g. {"ib-a": ["mlx5_0", "mlx5_1"]}.
    What is found goes through `advertise_fabrics`, the one place the ACTIVE-port and slowest-link rules
    live (the simulated inventory uses it too).
    """
    hcas, notes = read_hcas(declared, root)
    fabrics, more = advertise_fabrics(hcas)
    return fabrics, notes + more

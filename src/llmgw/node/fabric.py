"""Which InfiniBand fabrics a node advertises, from its adapters (HCAs) and their ports.

Seeds 001 ("Stop trusting hardware facts"): an adapter with no ACTIVE port carries no data (a port with a
link and no subnet manager sits in INIT, survives a reboot and looks healthy to anything counting
adapters), so it is not advertised, and a fabric left with no adapter is not advertised at all; the
reason is logged on the node, because the operator who declared the adapter is the one who can fix it.
A fabric's rate is its slowest active link, since a collective runs at the speed of its slowest member.

Used by the simulated inventory now; the sysfs discovery (issue 4) feeds the same function with what it
finds, after comparing declared adapters against discovered ones.
"""

from __future__ import annotations

from llmgw.schemas.inventory import HCA, Fabric


def advertise_fabrics(hcas: list[HCA]) -> tuple[list[Fabric], list[str]]:
    """(fabrics to advertise, notes on what was left out and why). Fabrics are sorted by name, their
    adapters by name; `rate_gbps` is the minimum over the active ports of the fabric's adapters."""
    notes: list[str] = []
    by_fabric: dict[str, list[HCA]] = {}
    for hca in hcas:
        active = [p for p in hca.ports if p.state.upper() == "ACTIVE"]
        if not active:
            states = ", ".join(f"port {p.number} is {p.state}" for p in hca.ports) or "it has no port"
            notes.append(f"adapter {hca.name} on fabric {hca.fabric} is not advertised: no ACTIVE port ({states})")
            continue
        by_fabric.setdefault(hca.fabric, []).append(hca.model_copy(update={"ports": active}))
    declared = sorted({h.fabric for h in hcas})
    for name in declared:
        if name not in by_fabric:
            notes.append(f"fabric {name} is not advertised: none of its adapters has an ACTIVE port")
    fabrics = [
        Fabric(name=name, adapters=sorted(h.name for h in members),
               rate_gbps=min(p.rate_gbps for h in members for p in h.ports))
        for name, members in sorted(by_fabric.items())
    ]
    return fabrics, notes

"""The base of every model that crosses between llmgw processes: Temporal workflow and activity inputs and
results (`payloads.py`, `mirror.py`), what a node sends the node API and reads back (`api.py`,
`inventory.py`).

A fleet runs two versions during every upgrade (docs/operating.md, "Upgrading llmgw"), so these models
follow one rule, which `tests/test_wire_compat.py` holds them to:
- a field is only ever added with a default (a sender one version older leaves it out);
- unknown fields are ignored, not refused (a sender one version newer may add one);
- a field's meaning never changes, and an activity whose meaning changes gets a new name.

What an operator or a client writes (the catalog, admin API bodies, `--simulate` inventories) is no wire:
there an unknown field is a typo and is refused (`extra="forbid"`, or `extra="forbid"` at the call).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A model that crosses processes: unknown fields from a newer sender are ignored."""

    model_config = ConfigDict(extra="ignore")

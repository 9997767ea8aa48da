"""This llmgw's version, as its package metadata says (pyproject.toml `version`).

Every process reports it: `llmgw --version`, the node worker's registration (`ctl nodes` VERSION), the
Temporal identity of every worker and client (`temporal.connect`), and the gateway's `/healthz` and
`/readyz`. docs/operating.md, "Upgrading llmgw", says which versions may run side by side.
"""

from __future__ import annotations

from importlib import metadata

try:
    VERSION = metadata.version("llmgw")
except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree that was never installed
    VERSION = "0+unknown"


def minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as `0.2.1` or `0.2.0.dev3`; None when it does not read so."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None

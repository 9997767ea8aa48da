"""This llmgw's version: pyproject.toml's `version` (from the source tree, else the package metadata).

Every process reports it: `llmgw --version`, the node worker's registration (its `User-Agent`; `ctl nodes`
VERSION), the
Temporal identity of every worker and client (`temporal.connect`), and the gateway's `/healthz` and
`/readyz`. docs/operating.md, "Upgrading llmgw", says which versions may run side by side.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

def _version() -> str:
    """The source tree's `pyproject.toml` when llmgw runs from one (an editable install's metadata keeps the
    version it was installed at), else the installed package's metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
        if project.get("name") == "llmgw":
            return str(project["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass
    try:
        return metadata.version("llmgw")
    except metadata.PackageNotFoundError:  # pragma: no cover - neither a source tree nor installed
        return "0+unknown"


VERSION = _version()

# What llmgw's own HTTP clients send (the node worker to the node API: its version, registered).
USER_AGENT = f"llmgw/{VERSION}"


def from_user_agent(value: str | None) -> str | None:
    """The version in an llmgw `User-Agent` (`llmgw/0.2.0`), or None for any other (at most 100 characters)."""
    if not value or not value.startswith("llmgw/"):
        return None
    version = value[6:].split(" ", 1)[0]
    return version if 0 < len(version) <= 100 and version.isprintable() else None


def minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as `0.2.1` or `0.2.0.dev3`; None when it does not read so."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None

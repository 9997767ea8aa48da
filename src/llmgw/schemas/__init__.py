"""Pydantic models shared across processes: catalog, inventory, workflow/activity payloads, API bodies."""

from pydantic import ValidationError


def problems_line(exc: ValidationError, what: str, first: int = 5, limit: int = 600) -> str:
    """A validation error as one short line, `field: message; ...` (`what` names a problem at the top), for
    stored data that no longer validates. Without pydantic's links and input echoes: a 3 MiB flag would be
    echoed into every log line and every `ctl` view."""
    errs = exc.errors()
    lines = [f"{'.'.join(str(p) for p in e['loc']) or what}: {e['msg']}" for e in errs[:first]]
    more = f"; and {len(errs) - first} more" if len(errs) > first else ""
    return ("; ".join(lines) + more)[:limit]

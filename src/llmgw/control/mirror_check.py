"""At apply: is every `mirror:` source the catalog names in the mirror? (A missing one used to be found only
when a replica's start fetched it and failed.)

One `GET /files` of the mirror's listing per apply (names and sizes, no hashing), with a short timeout. A
name neither listed nor being mirrored is refused when the catalog names it anew (issue 44: applied, it
only failed the starts later): `llmgw mirror add` first, and a download still running is enough. One the
live catalog already names (a file removed from the mirror since) is a note, so that an unrelated change is
not blocked by it; an unreachable mirror is said as such, never refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from llmgw.schemas.catalog import Catalog
from llmgw.spelling import closest
from llmgw.weights.naming import MIRROR_SCHEME

TIMEOUT_S = 2.0


def mirror_names(catalog: Catalog) -> dict[str, list[str]]:
    """`mirror:` name -> the models whose profiles name it (in catalog order)."""
    out: dict[str, list[str]] = {}
    for m in catalog.models:
        for p in m.profiles:
            if p.source and p.source.startswith(MIRROR_SCHEME):
                users = out.setdefault(p.source[len(MIRROR_SCHEME):].lstrip("/"), [])
                if m.name not in users:
                    users.append(m.name)
    return out


def missing(names: dict[str, list[str]], listing: dict) -> list[str]:
    """The names of `names` that the mirror's listing neither holds nor is mirroring: a file by its name, a
    version (`name/`) by any file under it."""
    files = {f.get("name") for f in listing.get("files", []) if isinstance(f, dict)}
    pending = {str(p).rstrip("/") for p in listing.get("pending", [])}
    out = []
    for name in names:
        bare = name.rstrip("/")
        held = any(f.startswith(bare + "/") for f in files if isinstance(f, str)) if name.endswith("/") else name in files
        if not held and bare not in pending:
            out.append(name)
    return out


@dataclass(frozen=True)
class Finding:
    """What the mirror check found: a `name` the mirror lacks, the `models` naming it and the advice; or, with
    `name` None, that the mirror could not be asked."""

    name: str | None
    models: tuple[str, ...]
    text: str

    def warning(self) -> str:
        return f"{', '.join(self.models)}: {self.text}" if self.name is not None else self.text

    def refusal(self) -> str:
        return (f"models ({', '.join(self.models)}).profiles.source `mirror:{self.name}`: {self.text}; a download "
                "in progress is enough (`--detach`), then apply again")


async def mirror_findings(catalog: Catalog, mirror_url: str) -> list[Finding]:
    names = mirror_names(catalog)
    if not names:
        return []
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            r = await client.get(mirror_url.rstrip("/") + "/files")
            r.raise_for_status()
            listing = r.json()
            if not isinstance(listing, dict):
                raise ValueError("its listing is not a JSON object")
    except (httpx.HTTPError, ValueError) as exc:
        return [Finding(None, (), f"could not ask the mirror at {mirror_url} whether it holds "
                                 f"{', '.join(sorted(names))} ({type(exc).__name__}); a start fails if it does not")]
    held = sorted({f.get("name") for f in listing.get("files", []) if isinstance(f, dict) and isinstance(f.get("name"), str)})
    out = []
    for n in missing(names, listing):
        meant = closest(n, held, cutoff=0.8)
        hint = f"did you mean `mirror:{meant}`, which it holds? Else " if meant else ""
        out.append(Finding(n, tuple(names[n]), f"the mirror has no {n!r} (nor is it being mirrored), so a start "
                                               f"fails until it is published: {hint}`llmgw mirror add <url> --name {n}`"))
    return out


async def mirror_warnings(catalog: Catalog, mirror_url: str) -> list[str]:
    """Every finding as a note (models first)."""
    return [f.warning() for f in await mirror_findings(catalog, mirror_url)]

"""At apply: is every `mirror:` source the catalog names in the mirror? (A missing one used to be found only
when a replica's start fetched it and failed.)

One `GET /files` of the mirror's listing per apply (names and sizes, no hashing), with a short timeout; a
name neither listed nor being mirrored is told as a note, not refused: it may be published after the
catalog (`llmgw mirror add`), and an unreachable mirror is said as such.
"""

from __future__ import annotations

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


async def mirror_warnings(catalog: Catalog, mirror_url: str) -> list[str]:
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
        return [f"could not ask the mirror at {mirror_url} whether it holds {', '.join(sorted(names))} "
                f"({type(exc).__name__}); a start fails if it does not"]
    held = sorted({f.get("name") for f in listing.get("files", []) if isinstance(f, dict) and isinstance(f.get("name"), str)})
    out = []
    for n in missing(names, listing):
        meant = closest(n, held, cutoff=0.8)
        hint = f"did you mean `mirror:{meant}`, which it holds? Else " if meant else ""
        out.append(f"{', '.join(names[n])}: the mirror has no {n!r} (nor is it being mirrored), so a start fails "
                   f"until it is published: {hint}`llmgw mirror add <url> --name {n}`")
    return out

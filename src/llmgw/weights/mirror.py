"""The mirror: a byte listener serving weight files and version manifests from one directory.

- `GET /files/<name>` serves a file (HTTP Range supported, so fetches resume), with its sha256 in the
  `X-Llmgw-Sha256` header.
- `GET /files/<name>/` serves a version's manifest: `{"files": [{"name", "size", "sha256"}]}`, built from
  the directory rather than a file beside it (a manifest on disk would disagree the first time someone
  copies a file in by hand, which the mirror allows). Refused with 409 while any `*.part` file is there.
- Names are validated segment by segment and the resolved path must stay under the root: no path is ever
  built from an unvalidated name.

It is separate from the admin API because every node needs it and the admin port must be closeable.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from llmgw.weights.fetcher import SHA_HEADER
from llmgw.weights.naming import SourceError, check_mirror_name

_sha_cache: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, cached by (path, size, mtime) so each file is hashed once."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _sha_cache:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _sha_cache[key] = h.hexdigest()
    return _sha_cache[key]


def resolve(root: Path, name: str) -> Path | None:
    """The path for a mirror name, or None when the name is invalid or escapes the root."""
    try:
        check_mirror_name(name)
    except SourceError:
        return None
    root = root.resolve()
    path = (root / name.rstrip("/")).resolve()
    if path != root and root not in path.parents:
        return None
    return path


def manifest(directory: Path) -> dict | None:
    """The manifest of a version directory, or None while a file is still being written into it."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    if any(p.name.endswith(".part") for p in files):
        return None
    return {"files": [{"name": p.name, "size": p.stat().st_size, "sha256": file_sha256(p)} for p in files]}


def create_mirror_app(root: Path) -> Starlette:
    root.mkdir(parents=True, exist_ok=True)

    async def files(request: Request) -> Response:
        name = request.path_params["name"]
        if name == "":
            return await index(request)
        path = resolve(root, name)
        if path is None:
            return JSONResponse({"error": "invalid name: use segments of letters, digits, '.', '_' and '-'"}, 400)
        if name.endswith("/"):
            if not path.is_dir():
                return JSONResponse({"error": f"no version named {name}"}, 404)
            m = await asyncio.to_thread(manifest, path)
            if m is None:
                return JSONResponse({"error": f"version {name} is still being written"}, 409)
            return JSONResponse(m)
        if not path.is_file() or path.name.endswith(".part"):
            return JSONResponse({"error": f"no file named {name}"}, 404)
        sha = await asyncio.to_thread(file_sha256, path)
        return FileResponse(path, headers={SHA_HEADER: sha}, filename=None)

    async def index(request: Request) -> Response:
        out = []
        for dirpath, _dirs, names in os.walk(root):
            for n in names:
                if not n.endswith(".part") and not n.startswith("."):
                    p = Path(dirpath) / n
                    out.append({"name": str(p.relative_to(root)), "size": p.stat().st_size})
        return JSONResponse({"files": sorted(out, key=lambda f: f["name"])})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[
        Route("/files/{name:path}", files), Route("/files", index), Route("/healthz", health),
    ])

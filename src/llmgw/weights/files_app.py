"""A byte listener serving weight files and version manifests from one directory: the mirror's
(mirror/server.py) and a node's peer listener over its cache (node/peer_server.py), which is why it lives in
the shared `weights/` layer.

- `GET /files/<name>` serves a file (HTTP Range supported, so fetches resume), with its sha256 in the
  `X-Llmgw-Sha256` header.
- `GET /files/<name>/` serves a version's manifest: `{"files": [{"name", "size", "sha256"}]}`, built from
  the directory rather than a file beside it (a manifest on disk would disagree the first time someone
  copies a file in by hand, which the mirror allows). The sha256s come from the record `mirror add` wrote
  while downloading (`manifest.file_sha256`), else are computed once: concurrent requests for one file
  share one computation.
- A name being mirrored (`llmgw mirror add`, still in `.staging`: the caller's `pending`) answers 409 "not
  ready yet", and so does
  a directory that is not whole: a `*.part` file in it, a shard its index names or a split-GGUF part
  missing. Never a partial manifest (seeds 000).
- Names are validated segment by segment and the resolved path must stay under the root: no path is ever
  built from an unvalidated name. Hidden entries (`.staging`, records, locks) are never listed or served.
- `/metrics`: with `metrics` (the mirror's): its worker's download progress and the requests answered by
  kind (telemetry.MirrorMetrics).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from llmgw.weights.download import SHA_HEADER
from llmgw.weights.manifest import INDEX, ManifestError, file_sha256, missing_parts, parse_index
from llmgw.weights.naming import SourceError, check_mirror_name

__all__ = ["create_files_app", "file_sha256", "manifest", "resolve"]


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


def manifest(directory: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) for a whole version directory, or (None, why it is not ready)."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    if any(p.name.endswith(".part") for p in files):
        return None, "a file is still being written into it"
    if not files:
        return None, "it holds no files"
    names = {p.name for p in files}
    try:
        index = parse_index((directory / INDEX).read_bytes()) if INDEX in names else None
    except ManifestError as exc:
        return None, str(exc)
    missing = missing_parts(names, index)
    if missing:
        return None, f"{', '.join(missing[:5])} missing"
    return {"files": [{"name": p.name, "size": p.stat().st_size, "sha256": file_sha256(p)} for p in files]}, None


def _not_ready(name: str, why: str) -> Response:
    return JSONResponse({"error": f"{name} is not ready yet: {why}", "ready": False}, 409)


def create_files_app(root: Path, metrics=None, pending=lambda: ()) -> Starlette:
    """Serve `root`. `pending()`: names still being written there, answered 409 (the mirror's staging)."""
    root.mkdir(parents=True, exist_ok=True)
    flights: dict[tuple[str, str], asyncio.Future] = {}

    async def once(kind: str, path: Path, fn):
        """`fn(path)` in a thread, shared by every request for the same `kind` and path that arrives while
        it runs: a thousand nodes asking for one unrecorded file start one hash, not a thousand (issue 36),
        and hold no thread each while they wait. A client that leaves does not cancel it for the others."""
        key = (kind, str(path))
        fut = flights.get(key)
        if fut is None:
            fut = flights[key] = asyncio.ensure_future(asyncio.to_thread(fn, path))
            fut.add_done_callback(lambda _: flights.pop(key, None))
        return await asyncio.shield(fut)

    def count(kind: str) -> None:
        if metrics is not None:
            metrics.requests.labels(kind).inc()

    async def files(request: Request) -> Response:
        name = request.path_params["name"]
        if name == "":
            return await index(request)
        # `head`: a file's size and sha256 alone, what a node fetching from a peer asks (weights/fetcher.py).
        count("manifest" if name.endswith("/") else "head" if request.method == "HEAD" else "file")
        path = resolve(root, name)
        if path is None:
            return JSONResponse({"error": "invalid name: use segments of letters, digits, '.', '_' and '-'"}, 400)
        if name.endswith("/"):
            if not path.is_dir():
                if name in pending():
                    return _not_ready(name, "it is still being mirrored")
                return JSONResponse({"error": f"no version named {name}"}, 404)
            m, why = await once("manifest", path, manifest)
            if m is None:
                return _not_ready(name, why or "incomplete")
            return JSONResponse(m)
        if not path.is_file() or path.name.endswith(".part"):
            if name in pending():
                return _not_ready(name, "it is still being mirrored")
            return JSONResponse({"error": f"no file named {name}"}, 404)
        sha = await once("sha256", path, file_sha256)
        return FileResponse(path, headers={SHA_HEADER: sha}, filename=None)

    async def index(request: Request) -> Response:
        count("index")

        def walk() -> list[dict]:
            out = []
            for dirpath, dirs, names in os.walk(root):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                for n in names:
                    if not n.endswith(".part") and not n.startswith("."):
                        p = Path(dirpath) / n
                        try:  # a dangling link, a name that is not UTF-8: not a file anyone can fetch
                            name = str(p.relative_to(root))
                            name.encode("utf-8")
                            if resolve(root, name) is None:  # a link out of the mirror: served to nobody
                                continue
                            out.append({"name": name, "size": p.stat().st_size})
                        except (OSError, UnicodeError):
                            continue
            return sorted(out, key=lambda f: f["name"])

        return JSONResponse({"files": await asyncio.to_thread(walk), "pending": sorted(pending())})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    routes = [Route("/files/{name:path}", files), Route("/files", index), Route("/healthz", health)]
    if metrics is not None:
        async def render(request: Request) -> Response:
            return Response(metrics.render(), media_type="text/plain; version=0.0.4")

        routes.append(Route("/metrics", render))
    return Starlette(routes=routes)

"""Where `mirror add` writes, and publishing: a version appears in the mirror whole, or not at all.

Files of `mirror/<name>/<version>` are fetched into `<mirror>/.staging/<key>/` (hidden: no mirror name
starts with a dot, so nothing under it is ever served). Publishing checks that every planned file is
there at its verified size, that the set is whole (every shard the index names, every split-GGUF part)
and that each weights file is whole by its own header, records the sha256 computed while downloading
(`.llmgw-sha256.json`), and then renames the staging directory to `<mirror>/<name>` in one step (a file:
links it into place). Until then the mirror answers the name with 409 "not ready yet", never with a
partial manifest.

A published name never changes: nodes cache weights by the source's name (`cache_name_for`), so other
bytes under a name already published would leave nodes serving different weights under one name.
Publishing another version under a taken name is refused; publishing the same files again (a retried
activity whose completion was lost, a second `mirror add`) is a no-op.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from llmgw.schemas.mirror import PublishInput, PublishResult
from llmgw.weights.manifest import (
    INDEX, SIDECAR, ManifestError, check_weights_file, file_sha256, fsync_dir, missing_parts, parse_index, read_sidecar,
    record_sha256, recorded_sha256,
)
from llmgw.weights.naming import check_mirror_name

STAGING = ".staging"
TARGET = ".target.json"
VERSION = ".llmgw-version"  # in a published version directory: the mirror version it was published as


class PublishError(RuntimeError):
    """A version that cannot be published as it is; the message says why."""


def staging_dir(root: Path, name: str, version: str) -> Path:
    key = hashlib.sha256(f"{name}\n{version}".encode()).hexdigest()[:20]
    return root / STAGING / key


def open_staging(root: Path, name: str, version: str, kind: str) -> Path:
    """The staging directory of one version, created with its target record (idempotent)."""
    check_mirror_name(name)
    d = staging_dir(root, name, version)
    d.mkdir(parents=True, exist_ok=True)
    target = d / TARGET
    if not target.exists():
        tmp = d / (TARGET + ".tmp")
        tmp.write_text(json.dumps({"name": name, "version": version, "kind": kind}))
        os.replace(tmp, target)
    return d


def pending(root: Path) -> dict[str, str]:
    """Names being mirrored now ({name: version}); a version's name is listed with its trailing `/`."""
    out = {}
    for t in (root / STAGING).glob(f"*/{TARGET}"):
        try:
            rec = json.loads(t.read_text())
            out[rec["name"] + ("/" if rec.get("kind") == "version" else "")] = rec["version"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def discard(root: Path, name: str, version: str) -> bool:
    """Remove a version's staging directory (canceled or failed). True when there was one."""
    d = staging_dir(root, name, version)
    if not d.exists():
        return False
    shutil.rmtree(d, ignore_errors=True)
    return True


def published_version(root: Path, name: str) -> tuple[bool, str | None]:
    """(whether `name` is in the mirror, the mirror version it was published as when `mirror add` did it)."""
    dest = root / check_mirror_name(name).rstrip("/")
    if dest.is_dir():
        try:
            return True, (dest / VERSION).read_text().strip() or None
        except OSError:
            return True, None
    if dest.is_file():
        rec = read_sidecar(dest.parent).get(dest.name)
        return True, rec.get("version") if isinstance(rec, dict) else None
    return False, None


def _holds(dest: Path, kind: str, want: dict[str, str]) -> bool:
    """Whether `dest` already holds exactly these files ({name: sha256})."""
    if kind == "file":
        return dest.is_file() and file_sha256(dest) == next(iter(want.values()))
    if not dest.is_dir():
        return False
    have = {p.name: p for p in dest.iterdir() if p.is_file() and not p.name.startswith(".")}
    return set(have) == set(want) and all(file_sha256(p) == want[n] for n, p in have.items())


def publish(root: Path, inp: PublishInput) -> PublishResult:
    """Publish a staged version (see the module docstring). Serialised per mirror by a lock; safe to call
    again after it succeeded. Raises `PublishError`."""
    check_mirror_name(inp.name)
    dest = root / inp.name
    source = f"mirror:{inp.name}" + ("/" if inp.kind == "version" else "")
    want = {f.name: f.sha256 for f in inp.files}
    size = sum(f.size for f in inp.files)
    (root / STAGING).mkdir(parents=True, exist_ok=True)
    with open(root / STAGING / ".publish.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stage = staging_dir(root, inp.name, inp.version)
        if _holds(dest, inp.kind, want):
            if stage.exists():
                shutil.rmtree(stage, ignore_errors=True)
            return PublishResult(source=source, files=len(want), bytes=size, already=True)
        if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
            raise PublishError(f"{inp.name} is already published with other files; a published name never changes "
                               "(nodes cache weights by name): mirror this under another --name")
        if not stage.is_dir():
            raise PublishError(f"nothing is staged for {inp.name} (version {inp.version}); mirror it again")
        _check_staged(stage, inp)
        record_sha256(stage, want)
        if inp.kind == "file":
            f = inp.files[0]
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(stage / f.name, dest)  # fails if the name was taken meanwhile, where rename would replace
            except FileExistsError:
                raise PublishError(f"{inp.name} was published by someone else meanwhile") from None
            record_sha256(dest.parent, {dest.name: f.sha256}, version=inp.version)
            fsync_dir(dest.parent)
            shutil.rmtree(stage, ignore_errors=True)
        else:
            for stray in stage.iterdir():  # partials of attempts that lost, locks, the target record
                if stray.name not in want and stray.name != SIDECAR:
                    stray.unlink()
            (stage / VERSION).write_text(inp.version)
            fsync_dir(stage)
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(stage, dest)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise PublishError(f"{inp.name} was published by someone else meanwhile") from None
                raise
            fsync_dir(dest.parent)
        return PublishResult(source=source, files=len(want), bytes=size)


def _check_staged(stage: Path, inp: PublishInput) -> None:
    names = set()
    for f in inp.files:
        p = stage / f.name
        if not p.is_file():
            raise PublishError(f"{f.name} is not in the staging directory; mirror {inp.name} again")
        if p.stat().st_size != f.size:
            raise PublishError(f"{f.name} has {p.stat().st_size} bytes, {f.size} were verified; mirror {inp.name} again")
        why = check_weights_file(p)
        if why:
            raise PublishError(f"{why}; the origin's file is not whole")
        names.add(f.name)
    index = None
    if INDEX in names:
        try:
            index = parse_index((stage / INDEX).read_bytes())
        except ManifestError as exc:
            raise PublishError(str(exc)) from None
    missing = missing_parts(names, index)
    if missing:
        raise PublishError(f"{inp.name} is not whole: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                           "missing")


def published_as(stage: Path, file_name: str) -> str:
    """The name a staged file is published under: the version's own name for a single file, else its own
    (read from the staging directory's target record)."""
    rec = json.loads((stage / TARGET).read_text())
    return rec["name"] if rec.get("kind") == "file" else file_name


def staged_record(stage: Path, name: str) -> str | None:
    """The sha256 recorded for a staged file (a fetch that completed before its activity's result was
    lost), when the file still matches the record."""
    p = stage / name
    if not p.is_file() or name not in read_sidecar(stage):
        return None
    return recorded_sha256(p)

"""Version manifests, file names, and when a set of files is whole.

A version's manifest is `{"files": [{"name", "size", "sha256"}]}`. Nodes take it from the mirror (or any
server) and fetch each file by name, so every field is checked before anything is fetched or any path is
built (issue 11): a sha256 is 64 lowercase hex digits, a size an integer (a string size or a malformed
sha256 made every fetch a full download that never matched, forever), a name one plain ASCII file name:
no separator, no control character or trailing newline, no lookalike such as U+2024 (one dot leader) or
U+FF0F (fullwidth solidus), which some filesystems and tools fold into `.` and `/`. A bad manifest
refuses the version, naming the field.

A set of files is whole when every shard a `model.safetensors.index.json` names is there and every part
of a split GGUF (`name-0000i-of-0000N.gguf`) is (seeds 000); the mirror gives out no manifest before.

The sha256 of a file the mirror wrote is recorded beside it in `.llmgw-sha256.json` (size and mtime with
it), computed while the file was downloaded, so the mirror never reads a 40 GB version again to answer
its manifest; a file copied in by hand (no record, or a record for another size or mtime) is hashed once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import struct
import threading
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
SHA256 = re.compile(r"[0-9a-f]{64}")
SPLIT_GGUF = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf")
INDEX = "model.safetensors.index.json"
SIDECAR = ".llmgw-sha256.json"
MAX_FILES = 10_000
MAX_JSON_BYTES = 64 << 20  # an index or manifest larger than this is not one


class ManifestError(ValueError):
    """A manifest, index or name that cannot be used; the message names the field and says why."""


def check_file_name(name: object, what: str = "file name") -> str:
    """One plain file name (see the module docstring). Returns it; raises `ManifestError`."""
    if not isinstance(name, str) or not FILE_NAME.fullmatch(name):
        raise ManifestError(
            f"{what} {name!r} is not allowed: use one plain name of ASCII letters, digits, '.', '_' and '-' "
            "(no path separator, no control or lookalike characters), starting with a letter or digit")
    if name.endswith(".part"):
        raise ManifestError(f"{what} {name!r} is not allowed: names ending in .part are files being written")
    if name.endswith(".lock"):  # the fetch of file X locks X.lock beside it, and removes that lock when X is done
        raise ManifestError(f"{what} {name!r} is not allowed: names ending in .lock are the locks of files being "
                            "fetched")
    return name


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    size: StrictInt = Field(ge=0)
    sha256: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_file_name(v)

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not SHA256.fullmatch(v):
            raise ValueError("must be 64 lowercase hex digits")
        return v


class Manifest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    files: list[ManifestFile] = Field(min_length=1, max_length=MAX_FILES)

    @field_validator("files")
    @classmethod
    def _unique(cls, v: list[ManifestFile]) -> list[ManifestFile]:
        seen: set[str] = set()
        for f in v:
            if f.name in seen:
                raise ValueError(f"file {f.name!r} is listed twice")
            seen.add(f.name)
        return v

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def parse_manifest(raw: bytes | str) -> Manifest:
    """Parse and check a version manifest. Raises `ManifestError` naming the first bad field."""
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "manifest"
        raise ManifestError(f"manifest field {where}: {err['msg']}") from None


def parse_index(raw: bytes) -> list[str]:
    """The shard names a `model.safetensors.index.json` maps weights to. Raises `ManifestError`."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{INDEX} is not JSON ({exc})") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise ManifestError(f"{INDEX} has no weight_map (an object of tensor name to shard file)")
    shards = set(wm.values())
    if len(shards) > MAX_FILES:
        raise ManifestError(f"{INDEX} names {len(shards)} shards; at most {MAX_FILES}")
    return sorted(check_file_name(s, f"shard named in {INDEX}") for s in shards)


def missing_parts(names: set[str], index_shards: list[str] | None) -> list[str]:
    """What a set of files lacks to be whole: shards the index names, parts of a split GGUF. Pure."""
    missing = [s for s in (index_shards or []) if s not in names]
    groups: dict[tuple[str, int], set[int]] = {}
    for n in names:
        m = SPLIT_GGUF.fullmatch(n)
        if m:
            groups.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
    for (stem, count), have in sorted(groups.items()):
        missing += [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1) if i not in have]
    return missing


def check_weights_file(path: Path) -> str | None:
    """Why a complete-looking file is not a whole weights file, or None. Safetensors: the header parses
    and its tensors end exactly at the end of the file (a truncated shard fails here even with no
    checksum to compare); GGUF: the magic."""
    size = path.stat().st_size
    if path.name.endswith(".safetensors"):
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name}: too short for a safetensors file ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                return f"{path.name}: safetensors header length {n} does not fit the file ({size} bytes)"
            try:
                header = json.loads(f.read(n))
            except ValueError:
                return f"{path.name}: safetensors header is not JSON"
        ends = [t["data_offsets"][1] for k, t in header.items()
                if k != "__metadata__" and isinstance(t, dict) and isinstance(t.get("data_offsets"), list)
                and len(t["data_offsets"]) == 2 and isinstance(t["data_offsets"][1], int)]
        if 8 + n + max(ends, default=0) != size:
            return f"{path.name}: its tensors end at byte {8 + n + max(ends, default=0)} but the file has {size}"
    elif path.name.endswith(".gguf"):
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return f"{path.name}: not a GGUF file (no GGUF magic)"
    return None


# ---- the sha256 record beside files the mirror wrote ---------------------------------------------

_sha_cache: dict[tuple[str, int, int], str] = {}
_sha_locks: dict[tuple[str, int, int], threading.Lock] = {}
_sha_locks_guard = threading.Lock()


def file_sha256(path: Path) -> str:
    """sha256 of a file: the record beside it when it still matches, else computed once per (path, size,
    mtime) and kept in memory. Threads asking for the same file at once wait for one computation (issue
    36: the mirror hashed an unrecorded file once per concurrent request, each pass reading it whole)."""
    recorded = recorded_sha256(path)
    if recorded:
        return recorded
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    done = _sha_cache.get(key)
    if done is not None:
        return done
    with _sha_locks_guard:
        lock = _sha_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _sha_cache:  # the first holder computes; the others find its result
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            _sha_cache[key] = h.hexdigest()
    with _sha_locks_guard:
        _sha_locks.pop(key, None)
    return _sha_cache[key]


def read_sidecar(directory: Path) -> dict[str, dict]:
    try:
        data = json.loads((directory / SIDECAR).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def recorded_sha256(path: Path) -> str | None:
    """The sha256 recorded for `path` when its size and mtime still match the record."""
    rec = read_sidecar(path.parent).get(path.name)
    if not isinstance(rec, dict):
        return None
    st = path.stat()
    if rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns and SHA256.fullmatch(str(rec.get("sha256"))):
        return rec["sha256"]
    return None


def record_sha256(directory: Path, entries: dict[str, str], version: str | None = None) -> None:
    """Record {file name: sha256} for files in `directory` (their size and mtime now; with `version`, the
    mirror version they were published as), atomically and under a lock, so concurrent writers in one
    directory do not lose each other's entries."""
    with open(directory / (SIDECAR + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_sidecar(directory)
        for name, sha in entries.items():
            st = (directory / name).stat()
            data[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
            if version:
                data[name]["version"] = version
        tmp = directory / f"{SIDECAR}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / SIDECAR)
        fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Make a rename or new entry in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Sources and cache names.

A profile's `source` is one of:
- `mirror:NAME` — a file in the llmgw mirror; `mirror:NAME/` — a version (a set of files) there;
- `http://...` / `https://...` — a file (or, ending in `/`, a version with a manifest) on any server;
- an absolute path (`/models/x.gguf`) or an explicitly relative one (`./x.gguf`) — already on the node;
- anything else (`Qwen/Qwen2.5-7B-Instruct`) — a model id passed to vLLM/SGLang untouched (seeds 000:
  treating every non-remote source as a path broke every vLLM profile).

The cache name is a hash of the source, so the set of files llmgw fetched is computable from the catalog
(seeds 000: reclaim deletes only what it can prove it fetched).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote, urlsplit

from llmgw.weights.manifest import FILE_NAME

MIRROR_SCHEME = "mirror:"
CACHE_NAME = re.compile(r"^[0-9a-f]{32}-[A-Za-z0-9._-]+$")


class SourceError(ValueError):
    """A source that cannot be used; the message says what to write instead."""


@dataclass(frozen=True)
class Source:
    kind: Literal["remote", "path", "model_id", "none"]
    raw: str | None
    url: str | None = None  # for remote sources, after resolving `mirror:`
    is_version: bool = False  # ends in "/": a set of files with a manifest


def check_mirror_name(name: str) -> str:
    """A mirror name is one or more safe path segments (`a.gguf`, `org/model/`). Raises `SourceError`."""
    parts = name[:-1].split("/") if name.endswith("/") else name.split("/")
    if not name or len(parts) > 8 or not all(FILE_NAME.fullmatch(p) for p in parts):
        raise SourceError(
            f"mirror name {name!r} is not allowed: use segments of letters, digits, '.', '_' and '-' "
            "separated by '/', for example mirror:SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    return name


GGUF_MAGIC = b"GGUF"


def not_a_gguf(name: str, path) -> str | None:
    """Why the file at `path`, published as `name`, is not the GGUF its name promises (llama.cpp would fail
    to load it minutes later, with the cause only in the engine's log), or None. Only `.gguf` names are
    judged: other files have no magic number llmgw knows."""
    if not name.lower().endswith(".gguf"):
        return None
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == GGUF_MAGIC:
        return None
    shown = head.decode("ascii", "replace").translate({c: "." for c in range(32)}) if head else "nothing"
    return (f"{name} is not a GGUF file (it begins with {shown!r}, not 'GGUF'): give the URL or path of the "
            "file itself (on Hugging Face a /resolve/ link, not /blob/), or mirror it under a name that does not "
            "end in .gguf")


def parse_source(source: str | None, mirror_url: str | None = None) -> Source:
    """Classify a source; with `mirror_url`, resolve `mirror:` names to URLs. Raises `SourceError`."""
    if not source:
        return Source("none", None)
    if source.startswith(MIRROR_SCHEME):
        name = source[len(MIRROR_SCHEME):].lstrip("/")
        check_mirror_name(name)
        url = None
        if mirror_url:
            url = mirror_url.rstrip("/") + "/files/" + quote(name)
        return Source("remote", source, url, source.endswith("/"))
    if source.startswith(("http://", "https://")):
        parts = urlsplit(source)
        if not parts.netloc:
            raise SourceError(f"source {source!r} has no host")
        return Source("remote", source, source, source.endswith("/"))
    if source.startswith(("/", "./", "../")):
        return Source("path", source)
    if "://" in source:
        raise SourceError(f"source {source!r}: only http(s):// and mirror: URLs can be fetched")
    return Source("model_id", check_model_id(source))


# A hub model id as Hugging Face spells one: `name` or `org/name`, each part letters, digits, '.', '_' and
# '-', beginning and ending with a letter or digit, at most 96 characters. The id goes to the engine as an
# argument of its own (vLLM's positional model), so one that began with '-' would be read as a flag:
# `--trust-remote-code` as a source, with the profile's next argument taken for the model, would turn on
# what the engine policy refuses.
MODEL_ID_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


def check_model_id(source: str) -> str:
    """`source` if it is a hub model id (`Qwen/Qwen2.5-7B-Instruct`); else `SourceError` saying what to write."""
    parts = source.split("/")
    if len(parts) <= 2 and all(MODEL_ID_PART.fullmatch(p) and ".." not in p and "--" not in p for p in parts):
        return source
    raise SourceError(f"source {source!r} is not a model id, a URL or a path: write a hub model id such as "
                      "Qwen/Qwen2.5-7B-Instruct (letters, digits, '.', '_' and '-', beginning and ending with a "
                      "letter or digit), mirror:NAME, an http(s) URL, or a path beginning with '/' or './'")


def cache_name_for(source: str) -> str:
    """`<sha256(source)[:32]>-<last path segment>`: stable, computable from the catalog, safe as a file name,
    and free of a URL's query string (a signed token would otherwise sit in a file name and the inventory)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:32]
    if source.startswith(("http://", "https://")):
        source = urlsplit(source).path or "/"  # never the query: it may carry a signed token
    tail = source.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", tail)[:80].lstrip(".") or "weights"
    return f"{digest}-{tail}"

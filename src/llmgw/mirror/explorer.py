"""The explorer: from what an operator pastes to the exact set of files a version consists of.

- A directory URL ending in `/` on any HTTP server is a safetensors repository layout: the index
  `model.safetensors.index.json` and every shard it names (or a single `model.safetensors`), `config.json`
  (required: vLLM and SGLang cannot load without it), and those of the tokenizer files and
  `generation_config.json` that exist. Nothing is listed (plain file servers have no listing); the names
  are the ones a vLLM/SGLang replica reads. Hugging Face works as `https://huggingface.co/ORG/MODEL/resolve/REV/`.
- A repository web page (`https://huggingface.co/ORG/MODEL`, `.../tree/main`, `.../blob/main/x.gguf`) is
  refused with the URL to write instead; any source that answers `text/html` is refused as a web page.
- A split GGUF (`name-00001-of-00003.gguf`, llama.cpp's `gguf-split` naming) is one version whichever of
  its parts are given: every part is probed, and a missing one is an error naming it.
- Other file URLs: one file is published as a file; several as one version (then `--name` is required).

`default_name` and `version_of` are pure: the CLI computes the workflow id `mirror/<name>/<version>` from
them before anything is fetched, so two operators pasting the same URLs (whatever signed tokens their
query strings carry) get the same workflow and one download.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from llmgw.schemas.mirror import ExploreInput, MirrorPlan, PlannedFile
from llmgw.weights.download import SHA_HEADER, Limits
from llmgw.weights.manifest import INDEX, MAX_FILES, MAX_JSON_BYTES, SHA256, SPLIT_GGUF, ManifestError, \
    check_file_name, parse_index
from llmgw.weights.naming import SourceError, check_mirror_name
from llmgw.weights.http import open_url, read_small
from llmgw.weights.urls import AddressPolicy, URLRefused, redact

REQUIRED = ("config.json",)
OPTIONAL = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
            "chat_template.json", "preprocessor_config.json")
HF_HOSTS = ("huggingface.co", "www.huggingface.co", "hf.co")
PROBES_AT_ONCE = 8


class ExploreError(RuntimeError):
    """A source that cannot be mirrored as given; the message says what to write instead."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


# ---- pure ---------------------------------------------------------------------------------------

def web_page_hint(url: str) -> str | None:
    """Why `url` is a repository web page rather than files, with the URL to write instead; None if not."""
    p = urlsplit(url)
    parts = [unquote(x) for x in p.path.split("/") if x]
    if (p.hostname or "") not in HF_HOSTS or len(parts) < 2 or parts[0] in ("datasets", "spaces", "api"):
        return None
    org, model, rest = parts[0], parts[1], parts[2:]
    base = f"https://huggingface.co/{org}/{model}/resolve"
    if not rest:
        instead = f"{base}/main/ (the repository's files, ending in /)"
    elif rest[0] == "tree" and len(rest) >= 2:
        instead = f"{base}/{'/'.join(rest[1:])}/ (the files under it, ending in /)"
    elif rest[0] == "blob" and len(rest) >= 3:
        instead = f"{base}/{'/'.join(rest[1:])} (the file itself)"
    else:
        return None
    return f"{redact(url)} is a repository web page, not files; write {instead}"


def split_gguf(url: str) -> tuple[str, int, int] | None:
    """(stem, part, parts) when `url` names a part of a split GGUF."""
    m = SPLIT_GGUF.fullmatch(_basename(url))
    return (m["stem"], int(m["i"]), int(m["n"])) if m else None


def canonical_sources(sources: list[str]) -> list[str]:
    """The sources with every split GGUF completed to all its parts (from any one part's URL), in order,
    without duplicates."""
    out: list[str] = []
    for s in sources:
        sg = split_gguf(s)
        if sg is None:
            urls = [s]
        else:
            stem, _, count = sg
            if count > MAX_FILES:
                raise ExploreError(f"{redact(s)}: a split GGUF of {count} parts is not plausible")
            urls = [_with_basename(s, f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
        out += [u for u in urls if u not in out]
    return out


def default_name(sources: list[str]) -> str:
    """The mirror name when `--name` is not given. Raises `ExploreError` when it cannot be derived."""
    if len(sources) == 1 and sources[0].endswith("/"):
        parts = [unquote(x) for x in urlsplit(sources[0]).path.split("/") if x]
        if (urlsplit(sources[0]).hostname or "") in HF_HOSTS and len(parts) >= 2 and "resolve" in parts:
            name = parts[1]
        elif parts:
            name = parts[-1]
        else:
            raise ExploreError(f"cannot name {redact(sources[0])}: give --name")
    else:
        stems = {sg[0] for sg in map(split_gguf, sources) if sg}
        if len(stems) == 1 and all(split_gguf(s) for s in sources):
            name = stems.pop()
        elif len(sources) == 1:
            name = _basename(sources[0])
        else:
            raise ExploreError("several files make one version: give it a name with --name NAME")
    try:
        return check_mirror_name(name)
    except SourceError as exc:
        raise ExploreError(f"{exc}; give --name") from None


def version_of(sources: list[str]) -> str:
    """A short id of what is mirrored: the canonical source URLs without query strings or fragments (a
    signed token is a credential, not part of what the file is)."""
    bare = sorted(urlunsplit((p.scheme, p.netloc.rsplit("@", 1)[-1].lower(), p.path, "", ""))
                  for p in map(urlsplit, canonical_sources(sources)))
    return hashlib.sha256("\n".join(bare).encode()).hexdigest()[:12]


def _basename(url: str) -> str:
    return unquote(urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1])


def _with_basename(url: str, name: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, p.path.rsplit("/", 1)[0] + "/" + quote(name), p.query, ""))


def _join(base: str, name: str) -> str:
    p = urlsplit(base)
    return urlunsplit((p.scheme, p.netloc, p.path + quote(name), p.query, ""))


def declared_sha256(headers_seen: list) -> str | None:
    """A sha256 the origin states for the file: llmgw's own header, or Hugging Face's `X-Linked-Etag` (the
    LFS object's sha256) on the redirect to its CDN. Anything else (an ETag that is not a sha256) is not one."""
    for h in headers_seen:
        for key in (SHA_HEADER, "X-Linked-Etag"):
            v = (h.get(key) or "").strip().strip('"').removeprefix("W/").strip('"').lower()
            if SHA256.fullmatch(v):
                return v
    return None


# ---- probing ------------------------------------------------------------------------------------

class Explorer:
    """Probes sources over HTTP with the mirror's address policy and limits (each request in a thread)."""

    def __init__(self, policy: AddressPolicy | None, limits: Limits = Limits()):
        self.policy = policy
        self.limits = limits
        self._sem = asyncio.Semaphore(PROBES_AT_ONCE)

    async def plan(self, inp: ExploreInput) -> MirrorPlan:
        """The files `inp.sources` stand for. Raises `ExploreError`."""
        for s in inp.sources:
            hint = web_page_hint(s)
            if hint:
                raise ExploreError(hint)
        dirs = [s for s in inp.sources if s.endswith("/")]
        if dirs and len(inp.sources) > 1:
            raise ExploreError(f"{redact(dirs[0])} is a directory (a whole repository layout): give it alone")
        if dirs:
            files = await self._layout(dirs[0])
            return MirrorPlan(name=inp.name, version=inp.version, kind="version", files=files)
        urls = canonical_sources(inp.sources)
        if len(urls) > MAX_FILES:
            raise ExploreError(f"{len(urls)} files; at most {MAX_FILES} in one version")
        names = [self._name(u) for u in urls]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ExploreError(f"two sources have the file name {sorted(dup)[0]}; a version holds one file per name")
        probed = await asyncio.gather(*(self._probe(u) for u in urls))
        files = []
        for url, name, got in zip(urls, names, probed):
            if got is None:
                sg = split_gguf(url)
                what = f"part {sg[1]} of {sg[2]} of the split GGUF {sg[0]}" if sg else "the file"
                raise ExploreError(f"{what} ({name}) is missing: {redact(url)} answered 404")
            files.append(PlannedFile(name=name, url=url, size=got[0], sha256=got[1]))
        return MirrorPlan(name=inp.name, version=inp.version, kind="file" if len(files) == 1 else "version",
                          files=files)

    async def _layout(self, base: str) -> list[PlannedFile]:
        index = await self._get_small(_join(base, INDEX))
        if index is not None:
            try:
                weights = [INDEX, *parse_index(index)]
            except ManifestError as exc:
                raise ExploreError(f"{redact(_join(base, INDEX))}: {exc}") from None
        elif await self._probe(_join(base, "model.safetensors")) is not None:
            weights = ["model.safetensors"]
        else:
            raise ExploreError(
                f"{redact(base)} holds neither {INDEX} nor model.safetensors: a directory URL must be a safetensors "
                "repository layout; for a GGUF give the file's URL (for a split GGUF, any of its parts)")
        names = [*weights, *REQUIRED, *OPTIONAL]
        probed = await asyncio.gather(*(self._probe(_join(base, n)) for n in names))
        files = []
        for name, got in zip(names, probed):
            if got is None:
                if name in OPTIONAL:
                    continue
                what = f"shard {name}, named in {INDEX}," if name not in REQUIRED else \
                    f"{name} (vLLM and SGLang need it)"
                raise ExploreError(f"{what} is missing: {redact(_join(base, name))} answered 404")
            files.append(PlannedFile(name=name, url=_join(base, name), size=got[0], sha256=got[1]))
        return files

    def _name(self, url: str) -> str:
        try:
            return check_file_name(_basename(url), "the file name in the URL")
        except ManifestError as exc:
            raise ExploreError(f"{redact(url)}: {exc}") from None

    async def _probe(self, url: str) -> tuple[int | None, str | None] | None:
        """(size, sha256) of `url` as its server states them, or None when it answers 404/410."""
        async with self._sem:
            return await asyncio.to_thread(self._request, url, False)

    async def _get_small(self, url: str) -> bytes | None:
        """A small document (an index), or None on 404/410. Refuses more than `MAX_JSON_BYTES`."""
        return await asyncio.to_thread(self._request, url, True)

    def _request(self, url: str, body: bool):
        try:
            opened = open_url(url, self.policy, None if body else {"Range": "bytes=0-0"},
                              timeout_s=self.limits.stall_s)
        except URLRefused as exc:
            raise ExploreError(str(exc)) from None
        except (OSError, http.client.HTTPException) as exc:
            raise ExploreError(f"{redact(url)}: {type(exc).__name__}", retryable=True) from None
        try:
            status, headers = opened.status, opened.headers
            if status in (404, 410):
                return None
            self._check(status, headers, url)
            if body:
                try:
                    return read_small(opened, MAX_JSON_BYTES)
                except ValueError:
                    raise ExploreError(f"{redact(url)} is larger than {MAX_JSON_BYTES} bytes; not an index") from None
            size = None
            if status == 206:
                total = (headers.get("Content-Range") or "").rsplit("/", 1)[-1]
                size = int(total) if total.isdigit() else None
            elif (headers.get("Content-Length") or "").isdigit():
                size = int(headers["Content-Length"])
            return size, declared_sha256([*opened.hop_headers, headers])
        except (OSError, http.client.HTTPException) as exc:
            raise ExploreError(f"{redact(url)}: {type(exc).__name__}", retryable=True) from None
        finally:
            opened.close()

    def _check(self, status: int, headers, url: str) -> None:
        if status >= 500 or status in (408, 429):
            raise ExploreError(f"{redact(url)}: HTTP {status}", retryable=True)
        if status not in (200, 206):
            raise ExploreError(f"{redact(url)}: HTTP {status}")
        ctype = headers.get("Content-Type") or ""
        if ctype.startswith(("text/html", "application/xhtml")):
            raise ExploreError(f"{redact(url)} is a web page ({ctype.split(';')[0]}), not a file: give the file's "
                               "download URL, or a directory URL ending in / that holds model.safetensors.index.json")

"""`MirrorWorkflow` and mirror activity inputs/outputs (one model in, one out), and the progress that
`llmgw mirror add/list` and the Temporal UI show. New fields get defaults; unknown fields are ignored (`schemas/wire.py`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from llmgw.schemas.wire import WireModel as _Wire


class MirrorState(StrEnum):
    """Where a mirror of one version stands. `published`: the manifest is given out; `failed`/`canceled`:
    nothing was published and the staging files were removed."""

    exploring = "exploring"
    downloading = "downloading"
    publishing = "publishing"
    published = "published"
    failed = "failed"
    canceled = "canceled"

    @classmethod
    def ended(cls) -> set["MirrorState"]:
        return {cls.published, cls.failed, cls.canceled}


class MirrorInput(_Wire):
    """Mirror `sources` (file URLs, or one directory URL ending in `/` holding a safetensors layout) as
    `name` in the mirror. `version` identifies the set of sources (`explorer.version_of`): with the
    name it makes the workflow id `mirror/<name>/<version>`. Timings come from the CLI's settings."""

    name: str
    version: str
    sources: list[str] = Field(min_length=1, max_length=1000)
    parallel_files: int = Field(default=4, ge=1, le=64)
    heartbeat_timeout_s: float = 30.0
    progress_interval_s: float = 2.0


class PlannedFile(_Wire):
    """One file to mirror: its name in the version, where from, and what the origin promised (size from
    Content-Length/Range, sha256 when a header states one)."""

    name: str
    url: str
    size: int | None = None
    sha256: str | None = None


class ExploreInput(_Wire):
    name: str
    version: str
    sources: list[str]


class MirrorPlan(_Wire):
    """`kind` `file`: one file published as `mirror:<name>`; `version`: a directory published as
    `mirror:<name>/` with a manifest."""

    name: str
    version: str
    kind: Literal["file", "version"]
    files: list[PlannedFile]
    published: bool = False  # this version is in the mirror already: nothing to fetch

    @property
    def source(self) -> str:
        return f"mirror:{self.name}" + ("/" if self.kind == "version" else "")


class FetchMirrorFileInput(_Wire):
    name: str
    version: str
    file: PlannedFile
    progress_interval_s: float = 2.0


class MirroredFile(_Wire):
    """A file present and verified in the version's staging directory. `received`: bytes fetched over HTTP
    by the attempt that completed it; `resumed_from`: bytes it found already on disk."""

    name: str
    size: int
    sha256: str
    resumed_from: int = 0
    received: int = 0


class PublishInput(_Wire):
    name: str
    version: str
    kind: Literal["file", "version"]
    files: list[MirroredFile]


class PublishResult(_Wire):
    source: str  # what a catalog profile writes: mirror:<name> or mirror:<name>/
    files: int
    bytes: int
    already: bool = False  # an identical version was already published (a retried publish, a re-run)


class DiscardInput(_Wire):
    name: str
    version: str


class DiscardResult(_Wire):
    removed: bool


class FileProgress(_Wire):
    """Sent by a fetch activity to its workflow (signal `file_progress`)."""

    file: str
    bytes: int
    total: int | None = None


class MirrorProgress(_Wire):
    """What the workflow's `progress` query returns and its memo holds. `total` is None while any file's
    length is unknown: then only bytes so far are shown, never an invented percentage (seeds 001)."""

    name: str
    version: str
    state: MirrorState = MirrorState.exploring
    sources: list[str] = Field(default_factory=list)  # redacted: no query strings (signed tokens)
    files: int = 0
    files_done: int = 0
    bytes: int = 0
    total: int | None = None
    source: str | None = None  # mirror:<name>[/] once planned
    reason: str | None = None  # why it failed

    def line(self) -> str:
        """One line for people: `downloading 1.2 GiB of 3.4 GiB (35%), 2 of 5 files`, `published as
        mirror:x/`, `failed: <reason>`."""
        if self.state == MirrorState.downloading:
            done = f"{human_bytes(self.bytes)} of {human_bytes(self.total)} ({100 * self.bytes // max(self.total, 1)}%)" \
                if self.total is not None else f"{human_bytes(self.bytes)} so far"
            return f"downloading {done}, {self.files_done} of {self.files} file(s) done"
        if self.state == MirrorState.published:
            return f"published as {self.source} ({self.files} file(s), {human_bytes(self.bytes)})"
        if self.state == MirrorState.failed:
            return f"failed: {self.reason}"
        return self.state.value


def human_bytes(n: int | None) -> str:
    """1536 -> '1.5 KiB'."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


class MirrorResult(_Wire):
    name: str
    version: str
    source: str
    files: int
    bytes: int

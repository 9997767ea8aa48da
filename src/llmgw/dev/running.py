"""Where a running `llmgw dev` keeps its state, for the commands run beside it (issue 44).

`LLMGW_STATE_DIR=/srv/llmgw llmgw dev` in one terminal and `llmgw mirror add model.gguf` in another, where
the variable is not set, put the file into ~/.local/share/llmgw/mirror, where that dev never looks; the
model then waited for a file it had been given. So a `llmgw dev` on any other state directory leaves a
pointer to it in the default one (`run/devs/<hash>.json`) while it runs, and a command given no state
directory follows it when exactly one such dev is running (its `dev.lock` held) and none runs on the
default directory, and says where it went. Pointers of devs that died unannounced are dropped when read:
a lock is held only by a live process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from llmgw.config import default_state_dir


def _pointers() -> Path:
    return default_state_dir() / "run" / "devs"


def _same(a: Path, b: Path) -> bool:
    return a.expanduser().resolve() == b.expanduser().resolve()


def announce(state_dir: Path) -> Path | None:
    """Leave a pointer to `state_dir` (a dev that holds its lock) in the default state directory; None when
    it is the default one. Best effort: a default directory that cannot be written only loses the hint."""
    if _same(state_dir, default_state_dir()):
        return None
    resolved = state_dir.expanduser().resolve()
    pointer = _pointers() / f"{hashlib.sha256(str(resolved).encode()).hexdigest()[:16]}.json"
    try:
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.write_text(json.dumps({"state_dir": str(resolved), "pid": os.getpid()}))
    except OSError:
        return None
    return pointer


def withdraw(pointer: Path | None) -> None:
    if pointer is not None:
        pointer.unlink(missing_ok=True)


def is_running(state_dir: Path) -> bool:
    """A `llmgw dev` holds `state_dir`'s lock now (tried without waiting, and without creating the file)."""
    try:
        fd = os.open(state_dir / "dev.lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also releases a lock just taken
    return False


def running_elsewhere() -> list[Path]:
    """State directories of the devs running on a directory other than the default, per their pointers."""
    found = []
    try:
        pointers = sorted(_pointers().glob("*.json"))
    except OSError:
        return []
    for p in pointers:
        try:
            state = Path(json.loads(p.read_text())["state_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            state = None
        if state is not None and is_running(state):
            found.append(state)
        else:
            p.unlink(missing_ok=True)  # its dev is gone (killed before it could withdraw it)
    return found


class Ambiguous(Exception):
    """Several devs run on other state directories and none on the default one: which is meant?"""


def client_state_dir(configured: Path, chosen: bool) -> tuple[Path, str | None]:
    """The state directory a command run beside `llmgw dev` should use, and a line saying why when it is
    not the configured one. `chosen`: the user set it (LLMGW_STATE_DIR, a flag); that always wins."""
    if chosen or is_running(configured):
        return configured, None
    others = running_elsewhere()
    if len(others) == 1:
        return others[0], (f"the running `llmgw dev` keeps its state in {others[0]} (not {configured}): "
                           "using it; set LLMGW_STATE_DIR to choose")
    if len(others) > 1:
        raise Ambiguous(f"{len(others)} `llmgw dev` run on other state directories ("
                        f"{', '.join(str(o) for o in others)}) and none on {configured}: set LLMGW_STATE_DIR to "
                        "the one meant, or pass --dir")
    return configured, None

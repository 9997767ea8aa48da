"""How an engine process ended, in words an operator can act on.

`Popen.returncode` is negative when a signal killed the process (-4 is SIGILL). "exited with code -4"
tells nobody anything; "killed by SIGILL (illegal instruction)" with the likely cause does.
"""

from __future__ import annotations

import re
import signal

# Why a signal usually reaches an engine, for the signals that have one usual cause.
_CAUSES = {
    signal.SIGILL: "the binary uses CPU instructions this machine cannot run",
    signal.SIGKILL: "often the kernel's out-of-memory killer (see `dmesg`), or a stop that ran past its grace",
    signal.SIGSEGV: "a crash inside the engine",
    signal.SIGBUS: "a crash inside the engine, often a truncated or changed memory-mapped weights file",
    signal.SIGABRT: "the engine aborted itself (an assertion or an uncaught error; see its output)",
}


UNKNOWN_EXIT = "exited (its exit status is unknown: it was adopted from an earlier node worker, not its child)"


def signal_of(code: int | None) -> signal.Signals | None:
    """The signal that ended a process whose return code is `code`, or None for a normal exit."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code)
    except ValueError:
        return None


def describe_exit(code: int | None, hints: dict[int, str] | None = None) -> str:
    """`exited with code 1`, `killed by SIGILL (illegal instruction): <cause>`, ...

    `hints` maps a signal number to an engine-specific cause that replaces the generic one.
    """
    if code is None:
        return "is still running"
    sig = signal_of(code)
    if sig is None:
        return f"exited with code {code}"
    text = f"killed by {sig.name} ({signal.strsignal(sig).lower()})"
    cause = (hints or {}).get(sig) or _CAUSES.get(sig)
    return f"{text}: {cause}" if cause else text


_SAYS_WHY = re.compile(r"error|exception|fatal|failed|abort|invalid|cannot|unable|not found|no such", re.I)
MAX_SAID = 200


def with_output(reason: str, tail: str, signalled: bool = False) -> str:
    """`reason` and the line of the engine's last output that most likely says why it ended: the last line
    that names an error, else (an exit of its own, not `signalled`) the last line; `exited with code 1: error
    while handling argument "--parallel": stoi`. An engine that exits at start usually says why in words
    (llama.cpp prints its usage after the error, so the very last line is seldom the one). One killed by a
    signal was stopped in whatever it was doing: its last line (`slot launch_slot_: id 0 | task 109 |
    processing task`) says nothing of why, and is left out. The whole output stays in `llmgw ctl logs`."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    if not lines:
        return reason
    line = next((ln for ln in reversed(lines) if _SAYS_WHY.search(ln)), None if signalled else lines[-1])
    if line is None:
        return reason
    line = line if len(line) <= MAX_SAID else line[:MAX_SAID] + "..."
    return f"{reason}: {line}" if line not in reason else reason

"""Engine process supervision on a node.

Each engine runs in its own process group (`start_new_session`), so a stop signals the whole group,
escalating from SIGTERM to SIGKILL. Each shard has a spec file (`<shard_dir>/<shard_id>.json`) holding
everything needed to describe it back to the control plane; a restarted worker adopts engines still
running from those files (seeds 001, "Survive a control plane restart"). An adopted engine is not this
process's child, so it is watched by polling and stopped by signalling its group. The process start
time is recorded beside the pid so that a recycled pid is never mistaken for the engine.

The spec file is written before the engine is spawned (pid 0: launching), and again with its pid once it
runs; every engine carries its shard id in its environment (`SHARD_MARKER`). A worker that died between
the spawn and the second write (issue 38) leaves a launching spec: the next boot finds the engine by its
marker and adopts it (`adopt_all`), so no engine runs unseen, holding its port and GPUs, while the retried
start launches a second one beside it.

A spec file holds the engine's key (a restarted worker reports it again, so the control plane can route
to an adopted engine): it is written mode 0600 in a 0700 directory, and logged argv is redacted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import psutil
from pydantic import ValidationError

from llmgw.engines.base import LaunchPlan, ShardSpec
from llmgw.node.compile_dirs import mark_warm
from llmgw.schemas.catalog import Profile
from llmgw.schemas.inventory import AdapterFile, ShardReport
from llmgw.schemas.payloads import Rendezvous
from llmgw.schemas.status import ShardStatus

log = logging.getLogger(__name__)
TAIL_BYTES = 4000
SHARD_MARKER = "LLMGW_SHARD_ID"  # in every engine's environment: the shard it was launched as


@dataclass
class Shard:
    spec: ShardSpec
    pid: int
    create_time: float
    endpoint: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None  # None when adopted from a previous worker
    state: str = ShardStatus.STARTING  # a `ShardStatus`, or "exited" (seen here to have exited; never reported)
    exit_code: int | None = None
    stopping: bool = False
    adopted: bool = False
    started_at: float = field(default_factory=time.time)
    start_ticks: int | None = None  # the process's start in clock ticks since boot (`proc_start_ticks`)
    asleep: bool = False  # its engine was put to sleep here (issue 39): it holds its weights in host memory
    # Served inside the node worker's own process (the fleet simulator's shared sim engine, node/sim_supervisor.py):
    # its pid is the worker's, it has no process group of its own, and it ends with the worker.
    in_process: bool = False

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    def report(self, state: str | None = None, tail: str | None = None, exit_reason: str | None = None,
               with_key: bool = True) -> ShardReport:
        """This shard as the node API wants it; `with_key=False` leaves the engine key out (heartbeats)."""
        return ShardReport(
            shard_id=self.shard_id, replica_id=self.spec.replica_id, model=self.spec.model,
            profile=self.spec.profile.name, rank=self.spec.rank, gpus=self.spec.gpus, state=state or self.state, pid=self.pid,
            endpoint=self.endpoint, exit_code=self.exit_code, exit_reason=exit_reason, output_tail=tail,
            profile_hash=self.spec.profile.spec_hash(), api_key=self.spec.api_key if with_key else None,
            adapters=dict(self.spec.adapter_files) if self.spec.adapter_files else None,
        )

    def to_json(self) -> dict:
        return {
            "shard_id": self.shard_id, "replica_id": self.spec.replica_id, "model": self.spec.model,
            "profile": self.spec.profile.model_dump(mode="json"), "rank": self.spec.rank, "gpus": self.spec.gpus,
            "weights_path": self.spec.weights_path, "host": self.spec.host, "port": self.spec.port,
            "pid": self.pid, "create_time": self.create_time, "start_ticks": self.start_ticks,
            "endpoint": self.endpoint, "argv": self.argv,
            "log_path": str(self.log_path), "state": self.state, "started_at": self.started_at,
            "rendezvous": self.spec.rendezvous.model_dump(mode="json") if self.spec.rendezvous else None,
            "api_key": self.spec.api_key, "sleep_mode": self.spec.sleep_mode, "asleep": self.asleep,
            "adapter_files": {k: v.model_dump(mode="json") for k, v in self.spec.adapter_files.items()},
            "compile_dir": self.spec.compile_dir, **({"in_process": True} if self.in_process else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Shard":
        spec = ShardSpec(shard_id=d["shard_id"], replica_id=d["replica_id"], model=d["model"],
                         profile=_profile_as_written(d["profile"], d["shard_id"]), rank=d["rank"], gpus=d["gpus"],
                         weights_path=d["weights_path"], host=d["host"], port=d["port"],
                         rendezvous=Rendezvous.model_validate(d["rendezvous"]) if d.get("rendezvous") else None,
                         api_key=d.get("api_key"), sleep_mode=bool(d.get("sleep_mode", False)),
                         adapter_files=_adapter_files(d.get("adapter_files"), d["shard_id"]),
                         compile_dir=d.get("compile_dir"))
        return cls(spec=spec, pid=d["pid"], create_time=d["create_time"], endpoint=d["endpoint"], argv=d["argv"],
                   log_path=Path(d["log_path"]), state=d.get("state", ShardStatus.STARTING), adopted=True,
                   started_at=d.get("started_at", time.time()), start_ticks=d.get("start_ticks"),
                   asleep=bool(d.get("asleep", False)), in_process=bool(d.get("in_process", False)))


def _adapter_files(raw: object, shard_id: str) -> dict[str, AdapterFile]:
    """The adapter files a spec file holds ({} when it has none or they cannot be read: its adapters are then
    refused by the gateway as not verified, never loaded from an unknown path)."""
    try:
        return {str(k): AdapterFile.model_validate(v) for k, v in (raw or {}).items()}  # type: ignore[union-attr]
    except (ValidationError, AttributeError) as exc:
        log.warning("shard %s's spec file holds adapter files this version cannot read (%s)", shard_id, exc)
        return {}


def _profile_as_written(raw: object, shard_id: str) -> Profile:
    """The profile a spec file holds. One written by another version of llmgw (a field added or removed, a
    stricter rule since) is read for what it still says: the engine it describes runs, and must be adopted
    and supervised, not forgotten while it holds its GPUs (a rollout replaces it if its profile is not the
    catalog's)."""
    try:
        return Profile.model_validate(raw)
    except ValidationError as exc:
        known = {k: v for k, v in raw.items() if k in Profile.model_fields} if isinstance(raw, dict) else {}
        log.warning("shard %s's spec file holds a profile this version reads differently (%s); adopting it as "
                    "written", shard_id, exc.errors()[0]["msg"])
        try:
            return Profile.model_validate(known)
        except ValidationError:
            return Profile.model_construct(**known)


def proc_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat), or None (gone, or
    not Linux). Unlike psutil's `create_time`, wall-clock seconds derived from the boot time as read now,
    it does not move when the system clock is stepped (NTP, a VM resumed): an engine adopted after a step
    is still recognised as the one launched."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int, create_time: float, start_ticks: int | None = None) -> bool:
    """Is the process that was launched as `pid` still running (not another that reuses the pid)? By its
    start ticks when they were recorded, else (a spec file from before them) by its create time. Pid 0:
    a spec written before its spawn (`launched_as`)."""
    if pid <= 0:
        return False
    try:
        p = psutil.Process(pid)
        if start_ticks is not None and (now := proc_start_ticks(pid)) is not None:
            same = now == start_ticks
        else:
            same = abs(p.create_time() - create_time) < 0.05
        return same and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def launched_as(shard_id: str, since: float) -> psutil.Process | None:
    """The process of this user launched as `shard_id` (its `SHARD_MARKER`) no earlier than `since` (epoch
    seconds, with a second's slack), or None: an engine whose worker died before recording its pid."""
    uid = os.getuid()
    for p in psutil.process_iter(["uids", "create_time"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != uid or (p.info["create_time"] or 0) < since - 1:
                continue
            if p.environ().get(SHARD_MARKER) == shard_id and p.status() != psutil.STATUS_ZOMBIE:
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return None


class Supervisor:
    """Starts, watches, adopts and stops engine processes on one node.

    `on_exit(shard, tail)` is awaited when a shard exits without being asked to stop.
    """

    def __init__(self, shard_dir: Path, log_dir: Path, on_exit: Callable[[Shard, str], Awaitable[None]] | None = None,
                 log_max_bytes: int = 256 << 20, crash_after_spawn: Path | None = None):
        self.shard_dir = shard_dir
        self.crash_after_spawn = crash_after_spawn  # test hook (tests/faults/): SIGKILL self after a spawn, once
        self.log_dir = log_dir
        self.on_exit = on_exit
        self.log_max_bytes = log_max_bytes
        self.shards: dict[str, Shard] = {}
        self._clearing: set[asyncio.Task] = set()  # a dead engine's report, and the rest of its process group
        shard_dir.mkdir(parents=True, exist_ok=True)
        shard_dir.chmod(0o700)  # spec files hold engine keys
        log_dir.mkdir(parents=True, exist_ok=True)
        log_dir.chmod(0o700)  # engine logs may hold engine keys and prompts

    # ---- spec files -----------------------------------------------------------------------------
    def _spec_path(self, shard_id: str) -> Path:
        return self.shard_dir / f"{shard_id}.json"

    def save(self, shard: Shard) -> None:
        """Write the shard's spec file atomically, readable by this user only (it holds the engine key)."""
        path = self._spec_path(shard.shard_id)
        tmp = path.with_suffix(".json.tmp")
        tmp.unlink(missing_ok=True)  # O_CREAT keeps an existing file's mode: start from none
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(shard.to_json()))
        os.replace(tmp, path)

    def _forget(self, shard_id: str) -> None:
        self.shards.pop(shard_id, None)
        self._spec_path(shard_id).unlink(missing_ok=True)

    def adopt_all(self) -> tuple[list[Shard], list[str]]:
        """Adopt every engine a previous worker left running. Returns (adopted, spec files of dead ones)."""
        adopted, dead = [], []
        for path in sorted(self.shard_dir.glob("*.json")):
            try:
                shard = Shard.from_json(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError) as exc:
                # Kept aside, not deleted: it is the only record of a process that may still run.
                log.error("unreadable shard spec %s (%s); moved to %s.bad: if its engine still runs, stop it by "
                          "hand", path, exc, path.name)
                dead.append(path.stem)
                path.replace(path.with_name(path.name + ".bad"))
                continue
            if shard.in_process:  # served by the worker that wrote it, and gone with it
                log.info("shard %s was served inside a previous worker's process; it ended with it", shard.shard_id)
                dead.append(shard.shard_id)
                path.unlink(missing_ok=True)
                continue
            if shard.pid <= 0:  # written before its spawn: its worker died before recording the pid
                found = launched_as(shard.shard_id, shard.started_at)
                if found is not None:
                    shard.pid, shard.create_time = found.pid, found.create_time()
                    shard.start_ticks = proc_start_ticks(found.pid)
                    self.save(shard)
                    log.warning("adopting shard %s (pid %d), launched by a worker that died before recording it",
                                shard.shard_id, shard.pid)
            if alive(shard.pid, shard.create_time, shard.start_ticks):
                log.info("adopting shard %s (pid %d); its earlier output is in %s", shard.shard_id, shard.pid, shard.log_path)
                self.shards[shard.shard_id] = shard
                adopted.append(shard)
            else:
                log.info("shard %s (pid %d) is no longer running", shard.shard_id, shard.pid)
                dead.append(shard.shard_id)
                path.unlink(missing_ok=True)
        return adopted, dead

    # ---- lifecycle -----------------------------------------------------------------------------
    def get(self, shard_id: str) -> Shard | None:
        return self.shards.get(shard_id)

    def running(self) -> list[Shard]:
        return [s for s in self.shards.values() if s.exit_code is None]

    def launch(self, spec: ShardSpec, plan: LaunchPlan, shown_argv: list[str] | None = None,
               keep_fds: tuple[int, ...] = ()) -> Shard:
        """Start `plan.argv` in a new process group with `plan.env`; output goes to the shard's log.
        `shown_argv` is what the log line says (the argv with any engine key redacted). `keep_fds` are
        inherited by the engine (its compile cache's lock: node/compile_dirs.py)."""
        log_path = self.log_dir / f"{spec.shard_id}.log"
        shard = Shard(spec=spec, pid=0, create_time=0.0, endpoint=plan.endpoint, argv=plan.argv, log_path=log_path)
        self.save(shard)  # before the spawn: a death between it and the save below leaves a record (module doc)
        # 0600 in a 0700 directory, as the spec files: an engine may print its key (SGLang logs its
        # `server_args`, api_key included) and, with request logging on, prompts.
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
            proc = subprocess.Popen(
                plan.argv, env={**plan.env, SHARD_MARKER: spec.shard_id}, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, pass_fds=keep_fds,
            )
        self._crash_hook(spec.shard_id, proc.pid)
        try:
            ctime = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            ctime = 0.0
        shard.pid, shard.create_time, shard.proc, shard.start_ticks = proc.pid, ctime, proc, proc_start_ticks(proc.pid)
        self.shards[spec.shard_id] = shard
        self.save(shard)
        log.info("launched shard %s (pid %d): %s", spec.shard_id, proc.pid, " ".join(shown_argv or plan.argv))
        return shard

    def _crash_hook(self, shard_id: str, pid: int) -> None:
        """Test hook: SIGKILL this worker right after spawning an engine, before its pid is recorded, once per
        marker file (which gets `shard_id pid`). Unset in any real deployment."""
        if self.crash_after_spawn is None:
            return
        try:
            fd = os.open(self.crash_after_spawn, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{shard_id} {pid}\n".encode())
        os.close(fd)
        log.warning("test hook: killing the node worker after spawning shard %s (pid %d)", shard_id, pid)
        os.kill(os.getpid(), signal.SIGKILL)

    def set_state(self, shard: Shard, state: str) -> None:
        shard.state = state
        if state == ShardStatus.READY and shard.spec.compile_dir:
            mark_warm(shard.spec.compile_dir)  # its compile is done: a scratch copy may start from it
        if shard.exit_code is None:
            self.save(shard)

    def set_asleep(self, shard: Shard, asleep: bool) -> None:
        """Record that the engine was put to sleep or woken (kept in its spec file, for an adopting agent)."""
        shard.asleep = asleep
        if shard.exit_code is None:
            self.save(shard)

    def poll(self, shard: Shard) -> int | None:
        """The exit code if the shard's process has exited, else None. Reaps our own children."""
        if shard.exit_code is not None:
            return shard.exit_code
        if shard.proc is not None:
            code = shard.proc.poll()
        else:
            code = None if alive(shard.pid, shard.create_time, shard.start_ticks) else -1
        if code is not None:
            shard.exit_code = code
        return code

    def tail(self, shard: Shard, size: int = TAIL_BYTES) -> str:
        """The end of the shard's log, its engine key replaced (SGLang logs its `server_args`, key included):
        every exit report and failure text is made from this."""
        try:
            with open(shard.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - size))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return text.replace(shard.spec.api_key, ENGINE_KEY_SHOWN) if shard.spec.api_key else text

    async def stop(self, shard_id: str, grace_s: float = 10.0) -> tuple[bool, int | None]:
        """SIGTERM the shard's process group, SIGKILL after `grace_s`. Returns (was running, exit code)."""
        shard = self.shards.get(shard_id)
        if shard is None:
            self._spec_path(shard_id).unlink(missing_ok=True)
            return False, None
        shard.stopping = True
        if self.poll(shard) is not None:
            await self._clear_group(shard, grace_s)
            self._forget(shard_id)
            return False, shard.exit_code
        self._signal(shard, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.poll(shard) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.poll(shard) is None:
            log.warning("shard %s did not stop within %.0fs; killing its process group", shard_id, grace_s)
            self._signal(shard, signal.SIGKILL)
            for _ in range(50):
                if self.poll(shard) is not None:
                    break
                await asyncio.sleep(0.1)
        await self._clear_group(shard, grace_s)
        self._forget(shard_id)
        return True, shard.exit_code

    async def _clear_group(self, shard: Shard, grace_s: float) -> None:
        """Once the engine's leader has exited, the rest of its process group too: vLLM's API server may exit
        while its EngineCore or tensor-parallel workers hang on, a `ray_launch` leader die while Ray's
        processes live, and a forgotten shard's children kept GPUs and ports that placement handed out
        again. SIGTERM, then SIGKILL after `grace_s`, until the group is empty (a group id is not reused
        while any member lives, so this never signals another group)."""
        if not self.group_alive(shard):
            return
        log.warning("shard %s's leader exited but its process group lives on; stopping the rest", shard.shard_id)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            self._signal(shard, sig)
            deadline = time.monotonic() + wait_s
            while self.group_alive(shard) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if not self.group_alive(shard):
                return
        log.error("shard %s's process group would not die (a process in uninterruptible sleep?)", shard.shard_id)

    def group_alive(self, shard: Shard) -> bool:
        """Whether anything of the shard's process group still lives (`_group_alive`)."""
        return _group_alive(shard.pid)

    def _signal(self, shard: Shard, sig: int) -> None:
        try:
            os.killpg(shard.pid, sig)  # the engine leads its own group (start_new_session)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.error("not permitted to signal shard %s (pid %d)", shard.shard_id, shard.pid)

    async def stop_all(self, grace_s: float = 10.0) -> None:
        await asyncio.gather(*(self.stop(sid, grace_s) for sid in list(self.shards)))

    def cap_logs(self) -> None:
        """Keep every engine's log under `log_max_bytes`: past it, its last MiB goes to `<shard>.log.1` and
        the log is emptied. The engine writes with O_APPEND, so it carries on at the new end."""
        for shard in list(self.shards.values()):
            try:
                if shard.log_path.stat().st_size <= self.log_max_bytes:
                    continue
                keep = min(1 << 20, self.log_max_bytes)
                with open(shard.log_path, "rb") as f:
                    f.seek(-keep, os.SEEK_END)
                    last = f.read(keep)
                kept = shard.log_path.with_name(shard.log_path.name + ".1")
                with os.fdopen(os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                    f.write(last)
                os.truncate(shard.log_path, 0)
                log.warning("shard %s's log passed %d MiB; its last MiB is in %s and the log starts again",
                            shard.shard_id, self.log_max_bytes >> 20, kept.name)
            except OSError as exc:
                log.warning("could not cap shard %s's log: %s", shard.shard_id, exc)

    async def watch(self, interval_s: float = 0.5) -> None:
        """Notice shards that exit on their own and report them through `on_exit`, and keep their logs
        bounded (`cap_logs`, every 10 s); runs until cancelled."""
        capped = time.monotonic()
        while True:
            if time.monotonic() - capped >= 10:
                capped = time.monotonic()
                self.cap_logs()
            for shard in list(self.shards.values()):
                if shard.stopping or shard.exit_code is not None and shard.state == "exited":
                    continue
                if self.poll(shard) is not None:
                    tail = self.tail(shard)
                    log.warning("shard %s exited with code %s", shard.shard_id, shard.exit_code)
                    shard.state = "exited"
                    if self.group_alive(shard):  # its leader died: what it started goes too (in the background)
                        task = asyncio.create_task(self._clear_group(shard, 5.0))
                        self._clearing.add(task)
                        task.add_done_callback(self._clearing.discard)
                    # Reported before it is forgotten: until then heartbeats still list it (as exited), so
                    # the control plane hears why it exited rather than only that it is gone. In the
                    # background: a report retried against an unreachable control plane must not keep the
                    # other engines' exits unnoticed meanwhile.
                    task = asyncio.create_task(self._report_exit(shard, tail))
                    self._clearing.add(task)
                    task.add_done_callback(self._clearing.discard)
            await asyncio.sleep(interval_s)

    async def _report_exit(self, shard: Shard, tail: str) -> None:
        if self.on_exit is not None:
            try:
                await self.on_exit(shard, tail)
            except Exception:  # noqa: BLE001 - the error is logged; the shard is forgotten all the same
                log.exception("reporting the exit of shard %s failed", shard.shard_id)
        if self.shards.get(shard.shard_id) is shard:
            self._forget(shard.shard_id)


ENGINE_KEY_SHOWN = "<engine key>"  # what an engine's log shows where it printed its key


def _group_alive(pgid: int) -> bool:
    """Whether any process that is not a zombie is left in process group `pgid` (a zombie holds nothing, and
    one whose parent never reaps it, as under a container's PID 1 that is not an init, would never go)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def kill_leftover_engines(shard_root: Path, node_id: str = "*") -> int:
    """SIGKILL the process group of every engine still alive under `<shard_root>/<node>/*.json` (one node,
    or all) and remove the spec files; for `llmgw dev` and tests after a worker died without stopping its
    engines. Returns how many were killed."""
    killed = 0
    for spec in shard_root.glob(f"{node_id}/*.json"):
        try:
            d = json.loads(spec.read_text())
            if d.get("in_process"):  # its pid is a fleet simulator's, not an engine's: never signalled
                spec.unlink(missing_ok=True)
                continue
            if d["pid"] <= 0 and (found := launched_as(d["shard_id"], d.get("started_at", 0))) is not None:
                d |= {"pid": found.pid, "create_time": found.create_time(), "start_ticks": proc_start_ticks(found.pid)}
            if alive(d["pid"], d["create_time"], d.get("start_ticks")):
                os.killpg(d["pid"], signal.SIGKILL)
                killed += 1
        except (OSError, ValueError, KeyError):
            pass
        spec.unlink(missing_ok=True)
    return killed

"""Many sim replicas served by one process (the fleet simulator's shared engine, issue 42).

`SharedSimEngine.start(argv, env, log_path)` takes what would have been the argv of one
`python -m llmgw.engines.sim_server` process (after the module name) and serves that replica on the
running asyncio loop instead: the same `SimEngine` and the same aiohttp app (`sim_server.make_app`: health,
`/v1/models`, completions, chat, messages, metrics, sleep and wake, LoRA), on its own listening port, held
to its own key (`LLMGW_SIM_API_KEY` of `env`). Its output lines ("sim: serving ...", "loaded, ready", the
stop) are appended to `log_path`, as a process's stdout would be, so the node's readiness cues and exit
tails read them as they read a process's.

`HostedReplica` is what `subprocess.Popen` is to a process: `pid` (the host process's), `poll()`,
`returncode`, `send_signal`/`terminate`/`kill`. SIGTERM stops it as the process stops (its in-flight
requests finished, then exit 0; `--ignore-sigterm` says so and goes on), SIGKILL closes its port at once
(-9). A flag the sim engine refuses ends it with 2 and argparse's message in its log. What it cannot be:
a multi-node shard (`--rank`, `--world-size` > 1: those run as processes, `hosts` says no), and an engine
that outlives its host: the replicas end with the simulator (module doc of node/sim_supervisor.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from llmgw.engines import sim_server

log = logging.getLogger(__name__)
SIM_MODULE = "llmgw.engines.sim_server"
STOP_TIMEOUT_S = 10.0  # a stopping replica's in-flight requests get this long (then its port closes anyway)


class _Refused(Exception):
    """argparse's error or exit, raised instead of ending the host process."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _parse(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    p = sim_server.parser(env.get("LLMGW_SIM_API_KEY"))

    def error(message: str):
        raise _Refused(f"{p.prog}: error: {message}")

    def leave(status: int = 0, message: str | None = None):
        raise _Refused(message or f"{p.prog}: exited", status)
    p.error, p.exit = error, leave  # type: ignore[method-assign]
    args = p.parse_args(argv)
    sim_server.check(p, args)
    return args


class HostedReplica:
    """One replica on the shared engine's loop, seen through a process's interface (module doc)."""

    def __init__(self, argv: list[str], log_path: Path, keep_fds: tuple[int, ...] = ()):
        self.pid = os.getpid()
        self.argv = argv
        self.log_path = log_path
        self.returncode: int | None = None
        self.args: argparse.Namespace | None = None
        self.engine: sim_server.SimEngine | None = None
        self._runner: web.AppRunner | None = None
        self._task: asyncio.Task | None = None
        self._stopping: asyncio.Task | None = None
        # The engine's inherited descriptors (its compile cache's lock), held until it ends, as a process holds them.
        self._fds = [os.dup(fd) for fd in keep_fds]
        self.ended = asyncio.Event()

    def say(self, line: str) -> None:
        """One line of output, appended to its log (opened and closed each time: a line is rare, a fleet's
        replicas many)."""
        try:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as exc:
            log.warning("cannot write the log of a hosted sim replica (%s): %s", self.log_path, exc)

    def poll(self) -> int | None:
        return self.returncode

    async def wait(self) -> int:
        await self.ended.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        if sig == signal.SIGKILL:
            self._end(-signal.SIGKILL)
            if self._task is not None:
                self._task.cancel()
            if self._runner is not None:  # the port closes; its open requests are dropped, not waited on
                self._stopping = asyncio.get_running_loop().create_task(self._runner.cleanup())
        elif sig in (signal.SIGTERM, signal.SIGINT):
            if self.args is not None and self.args.ignore_sigterm and sig == signal.SIGTERM:
                self.say("sim: ignoring SIGTERM")
            elif self._stopping is None:
                self._stopping = asyncio.get_running_loop().create_task(self._stop())

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def _stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()  # still starting: nothing served yet
        in_flight = self.engine.in_flight if self.engine is not None else 0
        self.say(f"sim: stopping with {in_flight} request(s) in flight")
        if self._runner is not None:
            await self._runner.cleanup()
        self._end(0)

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            for fd in self._fds:
                os.close(fd)
            self._fds = []
            self.ended.set()

    async def serve(self, env: dict[str, str]) -> None:
        """Parse its flags and listen, as `sim_server._serve` does; ends it with 2 (refused flags) or 1 (its
        port cannot be bound), the reason in its log."""
        try:
            self.args = args = _parse(self.argv, env)
            if args.rank > 0 or args.world_size > 1 or args.port is None:
                raise _Refused("llmgw-sim: a shared engine serves single-shard replicas with a --port only", 2)
            self.engine, mark, compile_s = sim_server.build_engine(args, None, env, say=self.say)
            self._runner = web.AppRunner(sim_server.make_app(self.engine, args.api_key), access_log=None,
                                         shutdown_timeout=STOP_TIMEOUT_S)
            await self._runner.setup()
            await web.TCPSite(self._runner, args.host, args.port).start()
        except _Refused as exc:
            self.say(str(exc))
            self._end(exc.code)
            return
        except Exception as exc:  # noqa: BLE001 - as a process that crashes: exit 1, the cause in its log
            where = f" on {self.args.host}:{self.args.port}" if self.args is not None else ""
            self.say(f"sim: cannot serve{where}: {type(exc).__name__}: {exc}")
            if self._runner is not None:
                await self._runner.cleanup()
            self._end(1)
            return
        self.say(f"sim: serving {args.model} on {args.host}:{args.port}")
        loop = asyncio.get_running_loop()
        delay = max(0.0, self.engine.ready_at - time.monotonic())
        if compile_s and mark is not None:
            loop.call_later(delay, sim_server.write_mark, mark)
        if args.startup_delay + compile_s > 0:
            loop.call_later(delay, lambda: self.returncode is None and self.say(f"sim: {args.model} loaded, ready"))


class SharedSimEngine:
    """Serves every hosted replica of this process on its loop (module doc). `replicas`: those running."""

    def __init__(self) -> None:
        self.replicas: set[HostedReplica] = set()

    @staticmethod
    def hosts(argv: list[str]) -> bool:
        """Whether `argv` is a sim engine this host serves: `<this python> -m llmgw.engines.sim_server ...`
        (the code this process runs, as engines/sim.py launches it), one shard (a multi-node shard joins a rendezvous as its own process)."""
        return (len(argv) >= 3 and argv[0] == sys.executable and argv[1:3] == ["-m", SIM_MODULE]
                and "--rendezvous" not in argv and "--rank" not in argv)

    def start(self, argv: list[str], env: dict[str, str], log_path: Path,
              keep_fds: tuple[int, ...] = ()) -> HostedReplica:
        """Serve the replica `argv` (a sim engine's full argv, `hosts(argv)`) describes; returns at once, as a
        spawn does (it listens a moment later). `env`: the environment its process would have had."""
        if not self.hosts(argv):
            raise ValueError(f"not a single-shard sim engine: {argv[:4]}")
        replica = HostedReplica(argv[3:], log_path, keep_fds)
        replica._task = asyncio.get_running_loop().create_task(replica.serve(env), name=f"sim {log_path.stem}")
        self.replicas.add(replica)
        asyncio.get_running_loop().create_task(self._forget(replica))
        return replica

    async def _forget(self, replica: HostedReplica) -> None:
        await replica.ended.wait()
        self.replicas.discard(replica)

    async def close(self) -> None:
        """End every replica (SIGKILL: the host is leaving, as a machine that loses power)."""
        replicas = list(self.replicas)
        for replica in replicas:
            replica.kill()
        await asyncio.gather(*(r._stopping for r in replicas if r._stopping is not None), return_exceptions=True)

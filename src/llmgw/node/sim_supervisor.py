"""The supervisor of a simulated node in the fleet simulator: sim shards served by one shared engine.

`SharedEngineSupervisor` is the node's ordinary `Supervisor` (spec files, logs, the exit watch, stop with
its grace, reports through `on_exit`) with one difference: a single-shard sim engine is not spawned as a
process but handed to the simulator's `SharedSimEngine` (engines/sim_shared.py), which serves it on its own
port in this process. Everything else launches as before (a multi-node sim shard, any other engine).

What differs from a process, and what the simulator cannot show (docs/architecture.md, "Fleet simulator"):
- the shard's pid is the simulator's (the node API wants a real pid); its spec file says `in_process`, so
  no sweep ever signals it (`kill_leftover_engines`) and a restarted simulator does not adopt it: the
  replicas ended with the process, the next registration reports them gone and the control plane replaces them;
- its memory is not held to the profile's `memory_gb` (node/health.py): it is the simulator's;
- a stop's SIGTERM and SIGKILL act on the replica (`HostedReplica.send_signal`), not on a process group.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import psutil

from llmgw.engines.base import LaunchPlan, ShardSpec
from llmgw.engines.sim_shared import HostedReplica, SharedSimEngine
from llmgw.node.supervisor import SHARD_MARKER, Shard, Supervisor, proc_start_ticks

log = logging.getLogger(__name__)


class SharedEngineSupervisor(Supervisor):
    """A `Supervisor` whose single-shard sim engines run in `engine` (module doc)."""

    def __init__(self, engine: SharedSimEngine, shard_dir: Path, log_dir: Path, **kwargs):
        super().__init__(shard_dir, log_dir, **kwargs)
        self.engine = engine
        me = psutil.Process()
        self._me = (me.pid, me.create_time(), proc_start_ticks(me.pid))

    def launch(self, spec: ShardSpec, plan: LaunchPlan, shown_argv: list[str] | None = None,
               keep_fds: tuple[int, ...] = ()) -> Shard:
        if not self.engine.hosts(plan.argv):
            return super().launch(spec, plan, shown_argv, keep_fds)
        log_path = self.log_dir / f"{spec.shard_id}.log"
        pid, ctime, ticks = self._me
        shard = Shard(spec=spec, pid=pid, create_time=ctime, start_ticks=ticks, endpoint=plan.endpoint,
                      argv=plan.argv, log_path=log_path, in_process=True)
        # The log exists before the engine writes, private as a process's log is (it may hold prompts).
        os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        shard.proc = self.engine.start(plan.argv, {**plan.env, SHARD_MARKER: spec.shard_id}, log_path,  # type: ignore[assignment]
                                       keep_fds)
        self.shards[spec.shard_id] = shard
        self.save(shard)
        log.info("launched shard %s in the shared sim engine: %s", spec.shard_id, " ".join(shown_argv or plan.argv))
        return shard

    def group_alive(self, shard: Shard) -> bool:
        if shard.in_process:
            return False  # no process group of its own: it is gone when it has ended
        return super().group_alive(shard)

    def _signal(self, shard: Shard, sig: int) -> None:
        if shard.in_process:
            if isinstance(shard.proc, HostedReplica):
                shard.proc.send_signal(sig)
            return  # one a previous simulator served is gone with it: never signal this process
        super()._signal(shard, sig)

    def poll(self, shard: Shard) -> int | None:
        if shard.in_process and not isinstance(shard.proc, HostedReplica) and shard.exit_code is None:
            shard.exit_code = -signal.SIGKILL  # written by an earlier simulator (adoption refuses these)
        return super().poll(shard)

"""The sim engine's process group: how the shards of a multi-node sim replica meet and stay together.

It plays what NCCL and torch.distributed do for a real tensor-parallel engine, over a line protocol of
JSON objects on one TCP address on rank 0's node (the replica's rendezvous):

- rank 0 listens there. A worker (rank > 0) connects, retrying while rank 0 is not up yet (workers start
  first), and sends `{"op": "join", "rank": r, "world_size": n, "token": T}`; rank 0 answers
  `{"ok": true}` or `{"ok": false, "error": ...}` (wrong token, rank taken or out of range). The
  connection stays open: it is the group.
- every request rank 0 serves is a collective: rank 0 sends `{"op": "step", "id": k}` to each worker and
  waits for `{"op": "ack", "id": k}`.
- anyone may ask `{"op": "status"}` and gets `{"joined": [ranks], "world_size": n, "token": T}`; the
  node worker asks this to tell that a worker has joined.
- a member that goes away breaks the group, as a dead rank breaks NCCL: rank 0 exits when a worker
  leaves, a worker exits when rank 0 does (exit code 3, with the reason on stderr). The node worker sees
  the exit and the whole replica fails, which is the rule the control plane enforces (seeds 003).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

EXIT_GROUP_BROKEN = 3


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) → (host, port). Raises ValueError."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _die(message: str) -> None:
    """Leave the way a broken collective leaves: at once, with a reason and a non-zero code."""
    print(f"sim: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_GROUP_BROKEN)


async def _send(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(json.dumps(obj).encode() + b"\n")
    await writer.drain()


class Group:
    """Rank 0's side: the listener, who has joined, and the per-request collective."""

    def __init__(self, address: str, world_size: int, token: str):
        self.host, self.port = split_address(address)
        self.world_size = world_size
        self.token = token
        self.members: dict[int, asyncio.StreamWriter] = {}
        self._acks: dict[str, asyncio.Future] = {}
        self._step = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def joined(self) -> list[int]:
        return [0, *sorted(self.members)]

    @property
    def complete(self) -> bool:
        return len(self.members) == self.world_size - 1

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = None
        try:
            line = await reader.readline()
            msg = json.loads(line or b"{}")
            if msg.get("op") == "status":
                await _send(writer, {"joined": self.joined, "world_size": self.world_size, "token": self.token})
                return
            if msg.get("op") != "join":
                await _send(writer, {"ok": False, "error": "expected join or status"})
                return
            rank = msg.get("rank")
            error = None
            if msg.get("token") != self.token:
                error = "this group belongs to another replica"
            elif not isinstance(rank, int) or not 0 < rank < self.world_size:
                error = f"rank {rank!r} is outside 1..{self.world_size - 1}"
            elif rank in self.members:
                error = f"rank {rank} has joined already"
            if error:
                rank = None
                await _send(writer, {"ok": False, "error": error})
                return
            self.members[rank] = writer
            await _send(writer, {"ok": True})
            print(f"sim: rank {rank} joined ({len(self.members) + 1} of {self.world_size})", flush=True)
            while True:
                line = await reader.readline()
                if not line:
                    break
                ack = json.loads(line)
                fut = self._acks.get(ack.get("id"))
                if fut is not None and not fut.done():
                    fut.set_result(None)
        except (OSError, ValueError):
            pass
        except asyncio.CancelledError:
            rank = None  # rank 0 itself is shutting down
            raise
        finally:
            if rank is not None:
                _die(f"rank {rank} left the group; a tensor-parallel replica cannot continue without it")
            writer.close()

    async def step(self, timeout_s: float = 30.0) -> None:
        """One collective across every worker (a stand-in for the all-reduce of a forward pass)."""
        if not self.members:
            return
        self._step += 1
        loop = asyncio.get_running_loop()
        futs = {f"{self._step}:{rank}": loop.create_future() for rank in self.members}
        self._acks.update(futs)
        try:
            for rank, w in list(self.members.items()):
                await _send(w, {"op": "step", "id": f"{self._step}:{rank}"})
            await asyncio.wait_for(asyncio.gather(*futs.values()), timeout_s)
        except (asyncio.TimeoutError, OSError):
            _die(f"collective {self._step} did not complete within {timeout_s:g}s")
        finally:
            for key in futs:
                self._acks.pop(key, None)


async def query_status(address: str, timeout_s: float = 2.0) -> dict | None:
    """Ask rank 0 of a group who has joined; None when it does not answer (not up yet, or gone)."""
    try:
        host, port = split_address(address)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, ValueError, asyncio.TimeoutError):
        return None
    try:
        await _send(writer, {"op": "status"})
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        return json.loads(line) if line else None
    except (OSError, ValueError, asyncio.TimeoutError):
        return None
    finally:
        writer.close()


async def run_worker(address: str, rank: int, world_size: int, token: str, join_timeout_s: float) -> None:
    """A worker shard: join rank 0 (retrying until `join_timeout_s`), then answer collectives until rank 0
    goes away, which ends the process with EXIT_GROUP_BROKEN."""
    host, port = split_address(address)
    deadline = time.monotonic() + join_timeout_s
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            break
        except OSError:
            if time.monotonic() > deadline:
                _die(f"rank {rank}: rank 0 did not appear at {address} within {join_timeout_s:g}s")
            await asyncio.sleep(0.2)
    await _send(writer, {"op": "join", "rank": rank, "world_size": world_size, "token": token})
    reply = json.loads(await reader.readline() or b"{}")
    if not reply.get("ok"):
        _die(f"rank {rank}: rank 0 at {address} refused to let it join: {reply.get('error', 'no answer')}")
    print(f"sim: rank {rank} joined rank 0 at {address}", flush=True)
    while True:
        line = await reader.readline()
        if not line:
            _die(f"rank {rank}: rank 0 went away; the group is broken")
        msg = json.loads(line)
        if msg.get("op") == "step":
            await _send(writer, {"op": "ack", "id": msg.get("id")})

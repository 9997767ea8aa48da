"""What the node activities may use of the node worker: a narrow protocol the `Agent` implements.

The activities run inside the agent's process, but they are commands from the control plane; keeping what
they can reach to this list (its parts, three questions to the node API, and two notes about the cache)
means a change inside the agent cannot silently change what a command does, and a test can hand the
activities a host of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmgw.engines.registry import Engines
    from llmgw.node.attempts import Attempts
    from llmgw.node.fences import Fences
    from llmgw.node.supervisor import Shard, Supervisor
    from llmgw.schemas.inventory import DownloadProgress
    from llmgw.schemas.payloads import LaunchCheckResponse, ShardReport
    from llmgw.weights.fetcher import Fetcher


class NodeHost(Protocol):
    node_id: str
    supervisor: "Supervisor"  # the engine processes of this node
    fences: "Fences"  # replicas this node was told to stop
    fetcher: "Fetcher"  # weights into the node's cache
    engines: "Engines"  # the engine adapters
    attempts: "Attempts"  # long activities running, for the next boot to end

    @property
    def advertise_host(self) -> str:
        """The address engines on this node are reached at."""

    @property
    def cache_dir(self) -> Path:
        """The node's weight cache."""

    @property
    def compile_cache_gb(self) -> float:
        """Disk the engines' compile caches may take (node/compile_dirs.py); 0: none kept."""

    async def report(self, report: "ShardReport", attempts: int = 5) -> None:
        """Tell the node API about a shard transition."""

    async def report_stopped(self, shard_id: str, attempts: int = 5) -> None:
        """Tell the node API a shard stopped."""

    async def launch_wanted(self, shard_id: str, replica_id: str, attempts: int = 2,
                            timeout_s: float = 3.0, cache_name: str | None = None) -> "LaunchCheckResponse":
        """Ask the node API whether this shard may still be launched (the last check before a spawn), and
        with `cache_name`, which peers hold those weights."""

    def describe_exit(self, shard: "Shard", tail: str = "") -> str:
        """An engine's exit, in words."""

    def download_progress(self, replica_id: str, progress: "DownloadProgress | None") -> None:
        """Weights being fetched for a replica (None: no longer); the heartbeat carries it."""

    def cache_changed(self, fetched_bytes: int = 0, peer_bytes: int = 0) -> None:
        """The cache gained (`fetched_bytes`, `peer_bytes` of them from peers) or lost files: the next
        heartbeat carries the inventory."""

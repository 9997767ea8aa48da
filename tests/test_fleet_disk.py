"""Disk room, through the real path: a node without room for the weights is refused unless it already
holds them, the weights are really fetched from the mirror by the chosen node, and `llmgw ctl explain`
names the reason for every node turned down."""

from __future__ import annotations

import pytest

from llmgw.weights.naming import cache_name_for
from tests.fleet import sim_spec
from tests.helpers import wait_until

pytestmark = pytest.mark.integration

CATALOG = {"models": [
    {"name": "held", "scaling": {"min": 1, "max": 1},
     "profiles": [{"engine": "sim", "source": "mirror:w.bin", "disk_gb": 50}]},
    {"name": "nowhere", "scaling": {"min": 1, "max": 1},
     "profiles": [{"engine": "sim", "source": "mirror:other.bin", "disk_gb": 50}]},
]}


def test_a_node_without_disk_room_is_refused_unless_it_holds_the_weights(control_plane):
    cp = control_plane.start(mirror=True)
    cp.mirror_dir.mkdir(parents=True, exist_ok=True)
    (cp.mirror_dir / "w.bin").write_bytes(b"w" * 4096)
    (cp.mirror_dir / "other.bin").write_bytes(b"o" * 4096)
    cp.agent("node-a", simulate=sim_spec(disk_free_gb=10))
    cp.agent("node-b", simulate=sim_spec(disk_free_gb=10, holds=["mirror:w.bin"]))
    cp.wait_nodes("node-a", "node-b")
    assert cp.apply(CATALOG).status_code == 200

    [rep] = cp.wait_replicas("held", timeout_s=60)
    assert rep["node_id"] == "node-b"
    assert (cp.state / "cache" / "node-b" / cache_name_for("mirror:w.bin")).is_file()  # fetched for real
    assert "node-b holds the weights" in rep["reason"]
    assert "default on node-a: needs 50 GB of disk for the weights, 10.0 GB free; it does not hold them" in rep["reason"]

    # The model nobody holds is refused on both nodes, each with its reason, in `llmgw ctl explain`.
    wait_until(lambda: cp.explain("nowhere")["decisions"], timeout_s=20, what="a pass about nowhere")
    out = cp.ctl("explain", "nowhere")
    assert out.returncode == 0, out.stderr
    assert "cannot place nowhere" in out.stdout
    for n in ("node-a", "node-b"):
        assert f"default on {n}: needs 50 GB of disk for the weights, 10.0 GB free; it does not hold them" in out.stdout
    # The pass that placed `held` is the latest one until the next pass finds it running (decide creates
    # what it places in the pass that decided it), so wait for a pass that keeps it.
    wait_until(lambda: any(line.startswith("keep held") for line in cp.explain("held")["decisions"]),
               timeout_s=20, what="a pass that keeps held")
    out = cp.ctl("explain", "held")
    assert "keep held: 1 of 1 wanted (min 1)" in out.stdout and "placed: place held/default on node-b" in out.stdout
    assert not [r for r in cp.replicas() if r["model"] == "nowhere"]

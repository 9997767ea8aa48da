"""Simulated inventories (`llmgw agent --simulate`), the fabric advertising rule, and the sim engine's
process group (real sim processes: a worker joins rank 0; one leaving breaks the group)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from llmgw.dev.procs import free_port, stop_process
from llmgw.schemas.inventory import HCA, HCAPort
from llmgw.weights.naming import cache_name_for
from llmgw.node.fabric import advertise_fabrics
from llmgw.node.simulate import SimulateError, load_spec, simulated_inventory
from tests.helpers import wait_until


def test_an_adapter_without_an_active_port_is_not_advertised_and_the_rate_is_the_slowest_link():
    fabrics, notes = advertise_fabrics([
        HCA(name="mlx5_0", fabric="ib-a", ports=[HCAPort(rate_gbps=400)]),
        HCA(name="mlx5_1", fabric="ib-a", ports=[HCAPort(rate_gbps=200), HCAPort(number=2, state="DOWN")]),
        HCA(name="mlx5_2", fabric="ib-b", ports=[HCAPort(state="INIT")]),
    ])
    assert [(f.name, f.adapters, f.rate_gbps) for f in fabrics] == [("ib-a", ["mlx5_0", "mlx5_1"], 200)]
    assert "adapter mlx5_2 on fabric ib-b is not advertised: no ACTIVE port (port 1 is INIT)" in notes
    assert "fabric ib-b is not advertised: none of its adapters has an ACTIVE port" in notes


def test_spec_inline_or_file(tmp_path):
    spec = load_spec('{gpus: 4, gpu_memory_gb: 40, nvlink: [[0, 1], [2, 3]], disk_free_gb: 10, holds: ["mirror:w.bin"],'
                     ' hcas: [{name: mlx5_0, fabric: ib-a}], engines: [sim]}')
    inv = simulated_inventory(spec, tmp_path / "cache", ["llamacpp", "sim"], [])
    assert [g.nvlink_peers for g in inv.gpus] == [[1], [0], [3], [2]]
    assert inv.gpus[0].memory_mb == 40 * 1024 and inv.disk_free_mb == 10 * 1024
    assert inv.engines == ["sim"] and inv.simulated
    assert inv.cached_sources == [cache_name_for("mirror:w.bin")]
    assert [f.name for f in inv.fabrics] == ["ib-a"]
    f = tmp_path / "node.yaml"
    f.write_text("gpus:\n  - {memory_gb: 24, nvlink_peers: [1]}\n  - {memory_gb: 80}\n")
    inv = simulated_inventory(load_spec(str(f)), tmp_path / "cache", ["sim"], [])
    assert [(g.memory_mb // 1024, g.nvlink_peers) for g in inv.gpus] == [(24, [1]), (80, [0])]


def test_a_bad_spec_names_the_field():
    with pytest.raises(SimulateError, match="gpu_memroy_gb: unknown field"):
        load_spec("{gpus: 2, gpu_memroy_gb: 3}")
    with pytest.raises(SimulateError, match="GPU index 5 does not exist"):
        load_spec("{gpus: 2, nvlink: [[0, 5]]}")
    with pytest.raises(SimulateError, match="expected a mapping"):
        load_spec("[1, 2]")


def _sim(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmgw.engines.sim_server", "--model", "m", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def test_sim_group_workers_join_rank_0_and_one_leaving_breaks_the_replica():
    rdv, http = f"127.0.0.1:{free_port()}", free_port()
    group = ["--world-size", "3", "--rendezvous", rdv, "--token", "rep-1"]
    procs = []
    try:
        # Workers first, as the start workflow launches them; they wait for rank 0.
        procs += [_sim("--rank", "1", *group), _sim("--rank", "2", *group)]
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs)
        procs.append(_sim("--rank", "0", "--port", str(http), "--tokens-per-second", "0", *group))
        rank0 = procs[-1]
        health = wait_until(lambda: _get(http, "/health"), timeout_s=20, what="rank 0 answering")
        health = wait_until(lambda: (h := _get(http, "/health")) and h.status_code == 200 and h, timeout_s=20,
                            what="every rank joined")
        assert health.json()["joined"] == [0, 1, 2]
        r = httpx.post(f"http://127.0.0.1:{http}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                              "max_tokens": 2}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "α β "
        # A stale worker of another replica on the same address is refused.
        stale = _sim("--rank", "1", "--world-size", "3", "--rendezvous", rdv, "--token", "other")
        procs.append(stale)
        assert stale.wait(10) == 3 and b"belongs to another replica" in stale.stdout.read()
        # A worker dying takes rank 0 down with it, as a dead rank takes down a collective.
        procs[0].kill()
        assert rank0.wait(10) == 3
        assert b"rank 1 left the group" in rank0.stdout.read()
        assert procs[1].wait(10) == 3  # and the other worker, which lost rank 0
    finally:
        for p in procs:
            stop_process(p, grace_s=2)


def _get(port: int, path: str):
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1)
    except httpx.HTTPError:
        return None

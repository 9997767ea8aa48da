"""What a real node worker advertises: declared InfiniBand adapters checked against (fake) sysfs, the
reason for each one left out logged on the node, and its Prometheus metrics (one sample per GPU)."""

from __future__ import annotations

import httpx
import pytest
import yaml

from llmgw.dev.procs import free_port, wait_port
from tests.helpers import wait_until
from tests.test_infiniband import hca

pytestmark = pytest.mark.integration


def test_agent_advertises_only_usable_adapters_and_says_why_and_its_gpus_in_metrics(control_plane, tmp_path):
    cp = control_plane.start()
    sysfs = tmp_path / "sysfs"
    hca(sysfs, "mlx5_0", ("4: ACTIVE", "200 Gb/sec (4X HDR)"))
    hca(sysfs, "mlx5_1", ("2: INIT", "200 Gb/sec (4X HDR)"))
    conf = tmp_path / "agent.yaml"
    conf.write_text(yaml.safe_dump({"fabrics": {"ib-a": ["mlx5_0", "mlx5_1", "mlx5_7"]},
                                    "infiniband_sysfs": str(sysfs)}))
    port = free_port()
    agent = cp.spawn("agent-ib", "agent", "--node-id", "ib-node", "--config", str(conf),
                     env={**cp.node_env("ib-node"), "LLMGW_AGENT_METRICS_PORT": str(port)})

    def node():
        nodes = httpx.get(cp.admin + "/admin/v1/nodes", headers=cp.admin_headers).json()
        return next((n for n in nodes if n["id"] == "ib-node"), None)

    n = wait_until(node, timeout_s=30, what="the node registered")
    assert n["inventory"]["fabrics"] == [{"name": "ib-a", "adapters": ["mlx5_0"], "rate_gbps": 200.0}]
    log = agent.log()
    assert "adapter mlx5_1 on fabric ib-a is not advertised: no ACTIVE port (port 1 is INIT)" in log
    assert "adapter mlx5_7 on fabric ib-a is declared but not on this node" in log
    wait_port(port, 10)
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert not [ln for ln in metrics.splitlines() if ln.startswith("llmgw_gpu_nvlink_peers{")]  # no GPU here

    # One sample per GPU with its peer count (a HELP/TYPE line alone would say nothing): two GPUs paired
    # by NVLink and one alone, on a node that declares them.
    port = free_port()
    cp.agent("gpu-node", simulate="{gpus: 3, gpu_memory_gb: 80, nvlink: [[0, 1]]}",
             LLMGW_AGENT_METRICS_PORT=str(port))
    cp.wait_nodes("gpu-node")
    wait_port(port, 10)
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    samples = {ln.split("{")[1].split(",")[0]: float(ln.split()[-1]) for ln in metrics.splitlines()
               if ln.startswith("llmgw_gpu_nvlink_peers{")}
    assert samples == {'gpu="0"': 1.0, 'gpu="1"': 1.0, 'gpu="2"': 0.0}, metrics

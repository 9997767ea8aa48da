"""Engine adapters build the engines' documented command lines: vLLM (`vllm serve`, Ray for multi-node)
and SGLang (`sglang.launch_server` with `--dist-init-addr`, `--nnodes`, `--node-rank`) for a TP8 replica
over two 4-GPU nodes; llama.cpp across several GPUs of one node. Never a shell string."""

from __future__ import annotations

import pytest

from llmgw.engines.base import EngineError, ShardSpec
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.metrics_text import gauge_sum
from llmgw.engines.ray_launch import count_active_nodes
from llmgw.engines.sglang import SglangAdapter
from llmgw.engines.vllm import VllmAdapter
from llmgw.schemas.catalog import Profile
from llmgw.schemas.payloads import Rendezvous

TP8 = Profile(engine="vllm", source="Qwen/Qwen2.5-72B-Instruct", tp=8, nodes=2, args=["--max-model-len", "8192"])
RZ = Rendezvous(address="10.0.0.1:6379", world_size=2, token="rep1")


def spec(profile: Profile, rank: int, host: str, gpus=(0, 1, 2, 3), rz=RZ) -> ShardSpec:
    return ShardSpec(shard_id=f"rep1-r{rank}", replica_id="rep1", model="qwen-72b", profile=profile, rank=rank,
                     gpus=list(gpus), weights_path=profile.source, host=host, port=8000, rendezvous=rz)


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_single_node_argv():
    p = Profile(engine="vllm", source="Qwen/Qwen2.5-7B-Instruct", tp=2)
    plan = VllmAdapter("/opt/vllm/bin/vllm", "/opt/vllm/bin/ray").build(spec(p, 0, "10.0.0.1", (0, 1), rz=None))
    assert plan.argv[:3] == ["/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]  # the bare id, untouched
    assert after(plan.argv, "--tensor-parallel-size") == "2" and after(plan.argv, "--pipeline-parallel-size") == "1"
    assert after(plan.argv, "--served-model-name") == "qwen-72b" and after(plan.argv, "--port") == "8000"
    assert "--distributed-executor-backend" not in plan.argv
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.endpoint == "http://10.0.0.1:8000"


def test_vllm_tp8_over_two_nodes_uses_ray():
    a = VllmAdapter("/opt/vllm/bin/vllm", "/opt/vllm/bin/ray")
    head = a.build(spec(TP8, 0, "10.0.0.1"))
    worker = a.build(spec(TP8, 1, "10.0.0.2"))
    # Rank 0: Ray head on the rendezvous port, then vllm serve over the Ray cluster of 2 nodes.
    parts = " ".join(head.argv).split(" -- ")
    assert "ray_launch head" in parts[0] and "--nodes 2" in parts[0]
    assert parts[1].split() == ["/opt/vllm/bin/ray", "start", "--head", "--node-ip-address", "10.0.0.1", "--port", "6379",
                                "--num-gpus", "4", "--include-dashboard", "false", "--block"]
    serve = parts[2].split()
    assert serve[:3] == ["/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-72B-Instruct"]
    assert after(serve, "--tensor-parallel-size") == "8"
    assert after(serve, "--distributed-executor-backend") == "ray"
    assert serve[3:5] == ["--max-model-len", "8192"]  # the profile's flags come before the worker's
    assert head.endpoint == "http://10.0.0.1:8000"
    # Rank 1: joins the head's address; serves no HTTP.
    wparts = " ".join(worker.argv).split(" -- ")
    assert wparts[1].split() == ["/opt/vllm/bin/ray", "start", "--address", "10.0.0.1:6379", "--node-ip-address",
                                 "10.0.0.2", "--num-gpus", "4", "--block"]
    assert worker.endpoint == ""


def test_sglang_tp8_over_two_nodes():
    p = Profile(engine="sglang", source="/models/qwen-72b/", tp=8, nodes=2)
    a = SglangAdapter("/opt/sglang/bin/python")
    r0 = a.build(spec(p, 0, "10.0.0.1")).argv
    r1 = a.build(spec(p, 1, "10.0.0.2")).argv
    for argv, rank in ((r0, "0"), (r1, "1")):
        assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
        assert after(argv, "--model-path") == "/models/qwen-72b/"
        assert after(argv, "--tp-size") == "8"  # SGLang's --tp-size is the total across nodes
        assert after(argv, "--nnodes") == "2" and after(argv, "--node-rank") == rank
        assert after(argv, "--dist-init-addr") == "10.0.0.1:6379"
    assert after(r0, "--port") == "8000" and "--port" not in r1  # only rank 0 serves HTTP


def test_llamacpp_splits_layers_across_gpus_of_one_node(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    p = Profile(engine="llamacpp", source="mirror:m.gguf", gpus_per_node=2)
    s = ShardSpec(shard_id="r-r0", replica_id="r", model="m", profile=p, gpus=[2, 3], weights_path="/cache/m.gguf",
                  port=9000)
    plan = LlamaCppAdapter(str(binary)).build(s)
    assert plan.argv[:3] == [str(binary), "--model", "/cache/m.gguf"]
    assert after(plan.argv, "--n-gpu-layers") == "999" and after(plan.argv, "--split-mode") == "layer"
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_llamacpp_is_given_the_first_part_of_a_split_gguf_version(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    version = tmp_path / "cache" / "abc-big"
    version.mkdir(parents=True)
    for i in (1, 2, 3):
        (version / f"big-{i:05d}-of-00003.gguf").write_bytes(b"GGUF")
    p = Profile(engine="llamacpp", source="mirror:big/")
    s = ShardSpec(shard_id="r-r0", replica_id="r", model="m", profile=p, weights_path=str(version), port=9000)
    assert after(LlamaCppAdapter(str(binary)).build(s).argv, "--model") == str(version / "big-00001-of-00003.gguf")
    (version / "other.gguf").write_bytes(b"GGUF")
    (version / "big-00001-of-00003.gguf").rename(version / "big-00004-of-00004.gguf")
    with pytest.raises(EngineError, match="not one split GGUF"):
        LlamaCppAdapter(str(binary)).build(s)


def test_profile_env_reaches_the_engine_and_nothing_else_does(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    p = Profile(engine="vllm", source="org/m", env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"})
    plan = VllmAdapter("vllm", "ray").build(spec(p, 0, "h", rz=None))
    assert plan.env["VLLM_ATTENTION_BACKEND"] == "FLASHINFER"
    assert "AWS_SECRET_ACCESS_KEY" not in plan.env and "LD_PRELOAD" not in plan.env


def test_ray_status_parsing_and_metric_sums():
    status = """======== Autoscaler status: 2026-11-29 12:00:00 ========
Node status
---------------------------------------------------------------
Active:
 1 node_5f4e3d2c1b0a
 1 node_0a1b2c3d4e5f
Pending:
 (no pending nodes)
Recent failures:
 (no failures)
"""
    assert count_active_nodes(status) == 2
    assert count_active_nodes("Active:\n (no active nodes)\nPending:\n") == 0
    text = 'vllm:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_waiting{model_name="m"} 7.0\n'
    assert gauge_sum(text, "vllm:num_requests_running") == 3 and gauge_sum(text, "sglang:num_running_reqs") is None


# ---- engines only the gateway can reach (issue 11) ---------------------------------------------

KEY = "k" * 43


def keyed(profile: Profile, rank: int, host: str, rz=RZ) -> ShardSpec:
    s = spec(profile, rank, host, rz=rz)
    s.api_key = KEY if rank == 0 else None
    return s


def test_each_engine_gets_its_key_where_it_reads_one_and_never_in_argv_when_it_can():
    vllm = VllmAdapter("/opt/vllm/bin/vllm", "/opt/vllm/bin/ray")
    single = vllm.build(keyed(Profile(engine="vllm", source="org/m"), 0, "10.0.0.1", rz=None))
    assert single.env["VLLM_API_KEY"] == KEY and KEY not in " ".join(single.argv)  # vLLM: VLLM_API_KEY
    head = vllm.build(keyed(TP8, 0, "10.0.0.1"))
    assert head.env["VLLM_API_KEY"] == KEY and KEY not in " ".join(head.argv)
    # SGLang reads no variable: `--api-key` on rank 0 (the only one serving HTTP), redacted in logs.
    sg = SglangAdapter("/opt/sglang/bin/python")
    p = Profile(engine="sglang", source="/models/qwen-72b/", tp=8, nodes=2)
    r0, r1 = sg.build(keyed(p, 0, "10.0.0.1")), sg.build(keyed(p, 1, "10.0.0.2"))
    assert after(r0.argv, "--api-key") == KEY and "--api-key" not in r1.argv
    assert KEY not in " ".join(sg.redact(r0.argv)) and "<engine key>" in sg.redact(r0.argv)


def test_llamacpp_key_goes_in_llama_api_key(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    s = ShardSpec(shard_id="r-r0", replica_id="r", model="m", profile=Profile(engine="llamacpp", source="mirror:m.gguf"),
                  weights_path="/cache/m.gguf", port=9000, api_key=KEY)
    plan = LlamaCppAdapter(str(binary)).build(s)
    assert plan.env["LLAMA_API_KEY"] == KEY and KEY not in plan.argv
    assert plan.env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU shard sees no GPU nobody gave it


def test_rendezvous_binds_the_advertised_address_only():
    # Ray (vLLM multi-node): every `ray start` names the node's advertised address, which Ray binds its
    # ports to (2.50+); the head runs no dashboard (its job API runs code). vLLM's own address is the same.
    a = VllmAdapter("/opt/vllm/bin/vllm", "/opt/vllm/bin/ray")
    head, worker = a.build(keyed(TP8, 0, "10.0.0.1")), a.build(keyed(TP8, 1, "10.0.0.2"))
    head_ray = " ".join(head.argv).split(" -- ")[1].split()
    assert after(head_ray, "--node-ip-address") == "10.0.0.1" and after(head_ray, "--include-dashboard") == "false"
    assert after(" ".join(worker.argv).split(" -- ")[1].split(), "--node-ip-address") == "10.0.0.2"
    assert head.env["VLLM_HOST_IP"] == "10.0.0.1" and worker.env["VLLM_HOST_IP"] == "10.0.0.2"
    # SGLang: the rendezvous is rank 0's advertised address, never a wildcard; HTTP on the advertised host.
    p = Profile(engine="sglang", source="/models/qwen-72b/", tp=8, nodes=2)
    r0 = SglangAdapter("/opt/sglang/bin/python").build(keyed(p, 0, "10.0.0.1"))
    assert after(r0.argv, "--dist-init-addr") == "10.0.0.1:6379" and after(r0.argv, "--host") == "10.0.0.1"


def test_collectives_stay_on_the_advertised_interface():
    # On this machine 127.0.0.1 is on the loopback interface: NCCL and Gloo are told to use exactly it.
    from llmgw.engines.base import interface_of

    lo = interface_of("127.0.0.1")
    assert lo
    rz = Rendezvous(address="127.0.0.1:6379", world_size=2, token="rep1")
    for adapter, profile in ((VllmAdapter("/v/vllm", "/v/ray"), TP8),
                             (SglangAdapter("/s/python"), Profile(engine="sglang", source="/m/", tp=8, nodes=2))):
        env = adapter.build(keyed(profile, 1, "127.0.0.1", rz=rz)).env
        assert env["NCCL_SOCKET_IFNAME"] == f"={lo}" and env["GLOO_SOCKET_IFNAME"] == lo
    single = VllmAdapter("/v/vllm", "/v/ray").build(keyed(Profile(engine="vllm", source="org/m"), 0, "127.0.0.1", rz=None))
    assert "NCCL_SOCKET_IFNAME" not in single.env  # one node: nothing leaves it


def test_an_engine_port_is_never_one_a_live_shard_has_or_one_handed_out_lately():
    """The kernel hands a free port out again (73 times in 20,000 here, the first at the 69th): an engine
    binds its port only once loaded (minutes, for SGLang), so two shards started together could get one
    port, and each other's readiness. The node now remembers what it handed out."""
    from llmgw.engines.base import EngineError, Ports

    given = iter([5000, 5000, 5001, 5002, 5001, 5003])
    ports = Ports(reserve=lambda host: next(given))
    assert ports.take("127.0.0.1", set()) == 5000
    assert ports.take("127.0.0.1", set()) == 5001  # 5000 handed out a moment ago
    assert ports.take("127.0.0.1", {5002}) == 5003  # 5002 a live shard's, 5001 handed out
    always = Ports(reserve=lambda host: 7000)
    always.take("127.0.0.1", set())
    with pytest.raises(EngineError, match="no free port"):
        always.take("127.0.0.1", set())

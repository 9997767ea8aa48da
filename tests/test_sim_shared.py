"""The fleet simulator's shared sim engine and its supervisor (issue 42), in one process: replicas served on
their own ports as the sim engine process serves them, stopped and killed as processes are, and what a
simulator leaves on disk never signalled or adopted by anyone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys

import aiohttp
import pytest

from llmgw.dev.procs import free_port
from llmgw.engines.base import ShardSpec
from llmgw.engines.sim import SimAdapter
from llmgw.engines.sim_shared import SharedSimEngine
from llmgw.node.sim_supervisor import SharedEngineSupervisor
from llmgw.node.supervisor import kill_leftover_engines
from llmgw.schemas.catalog import Profile
from llmgw.schemas.status import ShardStatus


def spec(shard_id: str, args: list[str] | None = None, key: str | None = "k-" + "x" * 40) -> ShardSpec:
    profile = Profile.model_validate({"engine": "sim", "args": args or ["--tokens-per-second", "0"]})
    return ShardSpec(shard_id=shard_id, replica_id=shard_id[:-3], model=f"m-{shard_id[:2]}",
                     profile=profile, port=free_port(), api_key=key)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def until(fn, timeout_s: float = 10):
    for _ in range(int(timeout_s / 0.02)):
        if v := fn():
            return v
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


@pytest.fixture
def sup(tmp_path):
    exits = []

    async def on_exit(shard, tail):
        exits.append((shard.shard_id, shard.exit_code, tail))
    s = SharedEngineSupervisor(SharedSimEngine(), tmp_path / "shards", tmp_path / "logs", on_exit=on_exit)
    s.exits = exits  # type: ignore[attr-defined]
    return s


async def _chat(endpoint: str, key: str | None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(endpoint + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"} if key else {},
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}) as r:
            return r.status, await r.json()


def test_two_replicas_are_served_in_this_process_each_on_its_port_with_its_key(sup):
    async def go():
        a, b = spec("ra-r0"), spec("rb-r0", key="other-" + "y" * 40)
        sa = sup.launch(a, SimAdapter().build(a))
        sb = sup.launch(b, SimAdapter().build(b))
        adapter = SimAdapter()
        async with aiohttp.ClientSession() as http:
            await until(lambda: listening(a.port) and listening(b.port))
            assert await adapter.is_ready(http, sa.endpoint, a.api_key)
            assert not await adapter.is_ready(http, sa.endpoint, b.api_key)  # each held to its own key
            async with http.get(sb.endpoint + "/v1/models", headers={"Authorization": f"Bearer {b.api_key}"}) as r:
                assert [m["id"] for m in (await r.json())["data"]] == [b.model]
        status, body = await _chat(sa.endpoint, a.api_key)
        assert status == 200 and body["choices"][0]["message"]["content"] == "α β γ "
        assert sa.pid == sb.pid == os.getpid() and sa.in_process and sup.poll(sa) is None
        assert "sim: serving m-ra on 127.0.0.1" in sa.log_path.read_text()  # the readiness cue, in its log
        assert await sup.stop(a.shard_id, grace_s=5) == (True, 0)
        assert not listening(a.port) and listening(b.port)  # its port closed, the other served on
        assert "stopping with 0 request(s) in flight" in sa.log_path.read_text()
        await sup.stop_all(grace_s=5)
        assert not listening(b.port) and not sup.shards
    asyncio.run(go())


def test_an_exit_is_seen_by_the_watch_and_reported_with_its_output(sup):
    async def go():
        bad = spec("rc-r0", ["--prefix-cache-blocks", "-1"])
        watch = asyncio.create_task(sup.watch(interval_s=0.02))
        shard = sup.launch(bad, SimAdapter().build(bad))
        await until(lambda: sup.exits)
        [(sid, code, tail)] = sup.exits
        assert (sid, code) == ("rc-r0", 2) and "--prefix-cache-blocks must be from 0" in tail
        assert shard.state == "exited" and "rc-r0" not in sup.shards

        ok = spec("rd-r0")
        shard = sup.launch(ok, SimAdapter().build(ok))
        await until(lambda: listening(ok.port))
        shard.proc.kill()  # what SIGKILL does to a process: its port closes, the watch reports -9
        await until(lambda: len(sup.exits) == 2)
        assert sup.exits[1][:2] == ("rd-r0", -signal.SIGKILL)
        await until(lambda: not listening(ok.port))
        watch.cancel()
    asyncio.run(go())


def test_a_wedged_replica_ignores_sigterm_and_is_killed_after_the_grace(sup):
    async def go():
        s = spec("re-r0", ["--tokens-per-second", "0", "--ignore-sigterm"])
        shard = sup.launch(s, SimAdapter().build(s))
        await until(lambda: listening(s.port))
        assert await sup.stop(s.shard_id, grace_s=0.3) == (True, -signal.SIGKILL)
        assert "sim: ignoring SIGTERM" in shard.log_path.read_text()
        await until(lambda: not listening(s.port))
    asyncio.run(go())


def test_a_multi_node_shard_is_still_a_process():
    py = sys.executable
    assert SharedSimEngine.hosts([py, "-m", "llmgw.engines.sim_server", "--model", "m", "--port", "1"])
    assert not SharedSimEngine.hosts([py, "-m", "llmgw.engines.sim_server", "--rank", "1", "--rendezvous", "h:1"])
    assert not SharedSimEngine.hosts(["llama-server", "-m", "llmgw.engines.sim_server"])
    assert not SharedSimEngine.hosts(["/other/python", "-m", "llmgw.engines.sim_server", "--port", "1"])


def test_what_a_simulator_left_is_neither_adopted_nor_signalled(sup, tmp_path):
    async def go():
        s = spec("rf-r0")
        shard = sup.launch(s, SimAdapter().build(s))
        sup.set_state(shard, ShardStatus.READY)
        path = sup._spec_path(s.shard_id)
        saved = json.loads(path.read_text())
        assert saved["in_process"] is True and saved["pid"] == os.getpid()  # this very process: alive
        # A restarted simulator (the same directories) does not adopt it: it ended with its process.
        again = SharedEngineSupervisor(SharedSimEngine(), sup.shard_dir, sup.log_dir)
        assert again.adopt_all() == ([], ["rf-r0"]) and not path.exists()
        # A sweep (llmgw dev, tests) never signals the pid it names: this process.
        sup.save(shard)
        assert kill_leftover_engines(tmp_path, "shards") == 0 and not path.exists()
        shard.proc.kill()
        await sup.engine.close()
    asyncio.run(go())


@pytest.mark.parametrize("args, says", [
    (["--nodes", "0"], "--nodes must be from 1 to 5000, not 0"),
    (["--nodes", "-3"], "--nodes must be from 1 to 5000, not -3"),
    (["--nodes", "99999999999999999999"], "--nodes must be from 1 to 5000"),
    (["--nodes", "5001"], "--nodes must be from 1 to 5000, not 5001"),
    (["--nodes", "x"], "Invalid value for '--nodes'"),
    (["--nodes", "3", "--node-prefix", "../"], "--node-prefix '../' makes node ids such as '../02'"),
    (["--nodes", "3", "--node-prefix", "a" * 62], "up to 63 characters"),
    (["--nodes", "3", "--pollers", "0"], "--pollers must be from 1 to 8, not 0"),
    (["--nodes", "3", "--pollers", "1000"], "--pollers must be from 1 to 8"),
    (["--nodes", "3", "--start-rate", "-1"], "--start-rate must be from 0"),
    (["--nodes", "3", "--start-rate", "nan"], "--start-rate must be from 0"),
    (["--nodes", "3", "--simulate", "{gpus: -1}"], "--simulate: spec: gpus: a count must be 0 or more"),
    (["--nodes", "3", "--simulate", "[1, 2]"], "--simulate: expected a mapping"),
])
def test_sim_fleet_refuses_abusive_options_with_a_clear_error(args, says, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from llmgw.cli import app

    monkeypatch.setenv("LLMGW_STATE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["sim-fleet", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


def test_sim_fleet_without_certificates_names_the_nodes_and_the_fix(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from llmgw.cli import app
    from llmgw.security.pki import create_ca

    create_ca(tmp_path / "pki")
    monkeypatch.setenv("LLMGW_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("LLMGW_CA_CERT", str(tmp_path / "pki" / "ca.crt"))
    monkeypatch.setenv("LLMGW_NODE_API_URL", "https://127.0.0.1:1")
    result = CliRunner().invoke(app, ["sim-fleet", "--nodes", "7"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no certificate in" in result.output and "for 7 node(s) (sim-00, sim-01, sim-02, sim-03, sim-04 ...)" \
        in result.output and "--issue-certs" in result.output
    nowhere = tmp_path / "nowhere"
    result = CliRunner().invoke(app, ["sim-fleet", "--nodes", "2", "--certs", str(nowhere)])
    assert result.exit_code == 2 and f"no certificate in {nowhere} (no such directory)" in result.output
    assert f"llmgw ctl cert node ID --dir {nowhere}" in result.output
    result = CliRunner().invoke(app, ["sim-fleet", "--nodes", "2", "--certs", str(nowhere), "--issue-certs"])
    assert result.exit_code == 2 and "pass --certs the directory that holds ca.key" in result.output


def test_sim_fleet_without_a_ca_certificate_says_to_set_it_and_where_dev_keeps_it(tmp_path, monkeypatch):
    """(A newcomer's run against `llmgw dev` without LLMGW_CA_CERT had every node end at once on a message
    about the activity key, which was not what to fix.)"""
    from typer.testing import CliRunner

    from llmgw.cli import app
    from llmgw.security.pki import create_ca

    monkeypatch.setenv("LLMGW_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("LLMGW_CA_CERT", raising=False)
    result = CliRunner().invoke(app, ["sim-fleet", "--nodes", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no CA certificate: set LLMGW_CA_CERT" in result.output
    assert f"under `llmgw dev`: {tmp_path / 'pki' / 'ca.crt'}" in result.output
    create_ca(tmp_path / "pki")  # as `llmgw dev` makes it: named as where it is
    result = CliRunner().invoke(app, ["sim-fleet", "--nodes", "2"])
    assert f"this machine's `llmgw dev` keeps it at {tmp_path / 'pki' / 'ca.crt'}" in result.output
    monkeypatch.setenv("LLMGW_CA_CERT", str(tmp_path / "nope" / "ca.crt"))
    result = CliRunner().invoke(app, ["sim-fleet", "--nodes", "2"])
    assert result.exit_code == 2 and f"LLMGW_CA_CERT={tmp_path / 'nope' / 'ca.crt'}: no such file" in result.output


def test_a_port_already_taken_ends_the_replica_with_1_and_says_why(sup):
    async def go():
        s = spec("rg-r0")
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", s.port))
            taken.listen()
            shard = sup.launch(s, SimAdapter().build(s))
            code = await asyncio.wait_for(shard.proc.wait(), 5)
        assert code == 1 and sup.poll(shard) == 1
        assert f"sim: cannot serve on 127.0.0.1:{s.port}: OSError" in shard.log_path.read_text()
    asyncio.run(go())

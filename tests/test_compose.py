"""docker-compose.yml as a production starting point (issue 14), read: every service, port, healthcheck and
variable it relies on is checked against what llmgw (its settings, commands and defaults), Temporal and the
files beside it actually provide. tests/test_compose_up.py runs it, with stand-ins for the images that
cannot be pulled here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
import yaml

from llmgw.catalog.loader import load_catalog
from llmgw.cli import app
from llmgw.config import Settings
from llmgw.node.simulate import load_spec
from llmgw.workflows.attributes import REGISTRY

REPO = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
LLMGW = {name for name, s in SERVICES.items() if s.get("build") == "."}
ONE_SHOT = {name for name, s in SERVICES.items() if s.get("restart") == "no"}
DEFAULTS = Settings.model_construct()  # the field defaults, without reading this environment


def env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (SERVICES[service].get("environment") or {}).items()}


def setting(service: str, field: str):
    """What llmgw in `service` reads for `field`: its LLMGW_ variable there, else the Dockerfile's, else
    the default."""
    dockerfile = dict(re.findall(r"(LLMGW_\w+)=(\S+)", (REPO / "Dockerfile").read_text()))
    key = f"LLMGW_{field.upper()}"
    return env(service).get(key, dockerfile.get(key, getattr(DEFAULTS, field)))


def healthcheck_url(service: str) -> str:
    test = " ".join(SERVICES[service]["healthcheck"]["test"])
    m = re.search(r"https?://[^'\" ]+", test)
    assert m, f"{service}: no URL in its healthcheck {test!r}"
    return m.group(0)


def test_every_long_running_service_has_a_healthcheck_and_every_dependency_a_condition():
    for name, s in SERVICES.items():
        if name not in ONE_SHOT:
            hc = s.get("healthcheck")
            assert hc and hc.get("test"), f"{name} has no healthcheck"
            assert hc["test"][0] in ("CMD", "CMD-SHELL"), name
        deps = s.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on must name a condition for each dependency"
        for dep, cond in deps.items():
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert cond == {"condition": want}, f"{name} -> {dep}: {cond} (want {want})"
    # Each one-shot setup service is waited for by something.
    waited = {d for s in SERVICES.values() for d in (s.get("depends_on") or {})}
    assert ONE_SHOT - {"catalog"} <= waited, ONE_SHOT - waited


def test_healthchecks_and_scrapes_use_the_ports_the_services_listen_on():
    assert healthcheck_url("server") == f"http://127.0.0.1:{setting('server', 'gateway_port')}/healthz"
    assert healthcheck_url("worker") == f"http://127.0.0.1:{setting('worker', 'control_metrics_port')}/metrics"
    assert healthcheck_url("agent-sim") == f"http://127.0.0.1:{setting('agent-sim', 'agent_metrics_port')}/metrics"
    assert healthcheck_url("mirror") == f"http://127.0.0.1:{setting('mirror', 'mirror_port')}/healthz"
    for svc in ("worker", "agent-sim", "mirror", "server"):
        assert setting(svc, "host") == "0.0.0.0", f"{svc} must listen beyond loopback for other containers"
    prom = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    targets = {job["job_name"]: t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets["gateway"] == f"server:{setting('server', 'gateway_port')}"
    assert targets["control-worker"] == f"worker:{setting('worker', 'control_metrics_port')}"
    assert targets["node-workers"] == f"agent-sim:{setting('agent-sim', 'agent_metrics_port')}"
    assert targets["temporal"] == "temporal:" + env("temporal")["PROMETHEUS_ENDPOINT"].rsplit(":", 1)[1]
    for job, target in targets.items():
        assert target.split(":")[0] in SERVICES, (job, target)


def test_published_ports_keep_the_admin_api_on_loopback():
    ports = {name: s.get("ports", []) for name, s in SERVICES.items()}
    assert set(ports["server"]) == {"8080:8080", "127.0.0.1:8081:8081", "8443:8443"}
    assert setting("server", "gateway_port") == 8080 and setting("server", "node_api_port") == 8443
    assert setting("server", "admin_port") == 8081 and setting("server", "admin_host") == "0.0.0.0"
    assert ports["temporal-ui"] == ["127.0.0.1:8233:8080"] and env("temporal-ui")["TEMPORAL_UI_PORT"] == "8080"
    assert env("server")["LLMGW_TEMPORAL_UI_URL"] == "http://127.0.0.1:8233"
    # Everything else that is published is on loopback: only the gateway and the node API face the network.
    for name, ps in ports.items():
        for p in ps:
            if name != "server" or p not in ("8080:8080", "8443:8443"):
                assert p.startswith("127.0.0.1:"), (name, p)


def test_every_llmgw_variable_is_a_setting_and_points_at_a_service():
    fields = set(Settings.model_fields)
    for name in LLMGW:
        for key, value in env(name).items():
            if key.startswith("LLMGW_"):
                assert key[len("LLMGW_"):].lower() in fields, f"{name}: {key} is not an llmgw setting"
        for key, value in env(name).items():
            for host, port in re.findall(r"//([a-z][\w-]*):(\d+)", value) + re.findall(r"^([a-z][\w-]*):(\d+)$", value):
                assert host in SERVICES or host == "127.0.0.1", f"{name}: {key} names {host}, not a service"
    s = env("server")
    assert s["LLMGW_TEMPORAL_ADDRESS"] == "temporal:7233" and s["LLMGW_MIRROR_URL"] == f"http://mirror:{setting('mirror', 'mirror_port')}"
    assert env("agent-sim")["LLMGW_NODE_API_URL"] == f"https://server:{setting('server', 'node_api_port')}"
    assert env("agent-sim")["LLMGW_ADVERTISE_HOST"] == "agent-sim"  # engines reachable from the gateway
    # The node API's certificate names the host agents dial; the node's certificate is the one it presents.
    pki = " ".join(SERVICES["pki"]["command"])
    assert "--host server" in pki and "cert node sim-1" in pki
    assert env("agent-sim")["LLMGW_NODE_CERT"] == "/pki/node-sim-1.crt"
    assert "sim-1" in SERVICES["agent-sim"]["command"]


def test_llmgw_commands_exist_and_their_arguments_parse():
    root = typer.main.get_command(app)
    for name in LLMGW:
        cmd = SERVICES[name].get("command")
        if not cmd or SERVICES[name].get("entrypoint"):
            continue
        node, words = root, list(cmd)
        while words and hasattr(node, "commands") and words[0] in node.commands:
            node = node.commands[words.pop(0)]
        assert not hasattr(node, "commands"), f"{name}: {cmd} is not an llmgw command"
        ctx = node.make_context(node.name, list(words), resilient_parsing=False)  # raises on unknown options
        assert ctx is not None
    spec = SERVICES["agent-sim"]["command"]
    assert load_spec(spec[spec.index("--simulate") + 1]).gpus == 2
    catalog = load_catalog(REPO / "deploy/catalog.yaml")
    assert [m.name for m in catalog.models] == ["sim-small"] and catalog.models[0].profiles[0].engine == "sim"
    assert SERVICES["catalog"]["network_mode"] == "service:server"  # the admin API answers only to localhost
    assert env("catalog")["LLMGW_ADMIN_URL"] == f"http://127.0.0.1:{setting('server', 'admin_port')}"


def test_secrets_come_from_the_env_file_and_every_variable_is_in_the_example():
    text = (REPO / "docker-compose.yml").read_text()
    used = set(re.findall(r"(?<!\$)\$\{(\w+)", text))
    example = (REPO / ".env.example").read_text()
    listed = set(re.findall(r"^#?\s*(\w+)=", example, re.M))
    assert used <= listed, used - listed
    assert re.search(r"^POSTGRES_PASSWORD=$", example, re.M)  # a secret is never given a value in git
    for name, s in SERVICES.items():
        for key, value in (s.get("environment") or {}).items():
            if re.search(r"PASSWORD|PWD|SECRET|TOKEN", key):
                assert str(value).startswith("${") and ":?" in str(value), f"{name}: {key} is inline, not from .env"
    assert "change-me" not in text
    assert ".env" in (REPO / ".gitignore").read_text().split()


def test_temporal_is_set_up_as_temporal_documents_for_production():
    assert not any("auto-setup" in str(s.get("image", "")) for s in SERVICES.values())
    schema = " ".join(SERVICES["temporal-schema"]["command"])
    assert "temporalio/admin-tools" in SERVICES["temporal-schema"]["image"]
    for db, folder in (("temporal", "temporal"), ("temporal_visibility", "visibility")):
        assert db in schema
    assert "update-schema -d \"/etc/temporal/schema/postgresql/v12/$$dir/versioned\"" in schema
    assert env("temporal-schema")["SQL_PLUGIN"] == env("temporal")["DB"] == "postgres12"
    assert env("temporal")["DBNAME"] == "temporal" and env("temporal")["VISIBILITY_DBNAME"] == "temporal_visibility"
    assert SERVICES["temporal"]["depends_on"] == {"temporal-schema": {"condition": "service_completed_successfully"}}
    # llmgw's search attributes, with the types llmgw sets, registered before the control worker starts.
    setup = " ".join(SERVICES["temporal-setup"]["command"])
    assert set(re.findall(r"(Llmgw\w+)=(\w+)", setup)) == set(REGISTRY.items())
    assert "temporal-setup" in SERVICES["worker"]["depends_on"]
    assert env("server")["LLMGW_TEMPORAL_NAMESPACE"] == "default" and "--namespace default" in setup


def test_every_process_exports_traces_to_the_collector():
    collector = yaml.safe_load((REPO / "deploy/otel-collector.yaml").read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert "health_check" in collector["service"]["extensions"]
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]
    for name in LLMGW - ONE_SHOT:
        tracing = setting(name, "tracing")
        assert tracing == f"otlp:http://otel-collector:{http.rsplit(':', 1)[1]}/v1/traces", (name, tracing)
        assert SERVICES[name]["depends_on"].get("otel-collector") or any(
            "otel-collector" in SERVICES[d].get("depends_on", {}) for d in SERVICES[name]["depends_on"]), name
    assert '".[otlp]"' in (REPO / "Dockerfile").read_text()  # the exporter is in the image


@pytest.mark.parametrize("script_service", ["temporal-schema", "temporal-setup", "pki"])
def test_setup_scripts_are_valid_shell(script_service, tmp_path):
    import subprocess

    script = SERVICES[script_service]["command"][0].replace("$$", "$")
    assert SERVICES[script_service]["entrypoint"][:2] == ["/bin/sh", "-euc"]
    r = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_service_that_talks_to_temporal_sees_the_keys_beside_the_ca():
    """The keys beside `ca.crt` (activity-signing.key/.pub, payload.key) are found through LLMGW_CA_CERT: a
    service that has the variable but not the volume neither signs, checks nor decrypts (the worker had no
    /pki: it could not sign, and the agent refused every activity)."""
    for name in LLMGW - ONE_SHOT - {"pki"}:
        if setting(name, "ca_cert") is None:
            continue
        ca_dir = str(Path(setting(name, "ca_cert")).parent)
        mounts = [v.split(":")[1] for v in SERVICES[name].get("volumes", [])]
        assert ca_dir in mounts, (name, mounts)
    script = " ".join(SERVICES["pki"]["command"]) if isinstance(SERVICES["pki"].get("command"), list) else \
        str(SERVICES["pki"].get("command") or SERVICES["pki"].get("entrypoint"))
    assert "cert payload-key" in script and "cert activity-key" in script

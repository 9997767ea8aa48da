"""InfiniBand discovery against a fake sysfs tree: declared-but-missing and INIT-only adapters are not
advertised, with a reason; a fabric's rate is its slowest active link."""

from __future__ import annotations

from pathlib import Path

from llmgw.node.infiniband import discover_fabrics, parse_rate


def hca(root: Path, name: str, *ports: tuple[str, str]) -> None:
    for i, (state, rate) in enumerate(ports, start=1):
        d = root / name / "ports" / str(i)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "rate").write_text(rate + "\n")


def test_only_present_adapters_with_an_active_port_are_advertised(tmp_path):
    hca(tmp_path, "mlx5_0", ("4: ACTIVE", "200 Gb/sec (4X HDR)"))
    hca(tmp_path, "mlx5_1", ("4: ACTIVE", "100 Gb/sec (4X EDR)"), ("1: DOWN", "10 Gb/sec (4X SDR)"))
    hca(tmp_path, "mlx5_2", ("2: INIT", "200 Gb/sec (4X HDR)"))
    fabrics, notes = discover_fabrics({"ib-a": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]}, tmp_path)
    [f] = fabrics
    assert f.name == "ib-a" and f.adapters == ["mlx5_0", "mlx5_1"]
    assert f.rate_gbps == 100  # the slowest active link
    assert any("adapter mlx5_2 on fabric ib-a is not advertised: no ACTIVE port (port 1 is INIT)" in n for n in notes)
    assert any("adapter mlx5_3 on fabric ib-a is declared but not on this node" in n for n in notes)


def test_a_fabric_with_no_usable_adapter_is_not_advertised(tmp_path):
    hca(tmp_path, "mlx5_0", ("2: INIT", "200 Gb/sec (4X HDR)"))
    fabrics, notes = discover_fabrics({"ib-a": ["mlx5_0"], "ib-b": ["mlx5_9"]}, tmp_path)
    assert fabrics == []
    assert any("fabric ib-a is not advertised: none of its adapters has an ACTIVE port" in n for n in notes)
    assert any("fabric ib-b is not advertised: none of its declared adapters is on this node" in n for n in notes)


def test_no_sysfs_at_all(tmp_path):
    fabrics, notes = discover_fabrics({"ib-a": ["mlx5_0"]}, tmp_path / "absent")
    assert fabrics == [] and "present: none" in notes[0]


def test_rate_parsing():
    assert parse_rate("400 Gb/sec (4X NDR)") == 400
    assert parse_rate("56 Gb/sec (4X FDR)") == 56
    assert parse_rate("garbage") == 0

from __future__ import annotations

from pathlib import Path

import pytest

from helixserve.errors import UserError
from helixserve.spec import LinkSpec, load_cluster

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"

BASE = """
name: t
nodes:
  - {name: a, gpu: A100-40GB, region: r1}
  - {name: b, gpu: T4, num_gpus: 2, region: r2, nic_gbps: 5}
  - {name: c, gpu: L4, region: r1, memory_gb: 12.5}
links:
  default: {bandwidth_gbps: 8.0, latency_ms: 1.0}
  between_regions:
    - {a: r1, b: r2, bandwidth_gbps: 0.5, latency_ms: 40}
  explicit:
    - {src: a, dst: c, bandwidth_gbps: 100, latency_ms: 0.1}
    - {src: c, dst: a, bandwidth_gbps: 0}
    - {src: coordinator, dst: b, bandwidth_gbps: 2.0, latency_ms: 3}
coordinator: {region: r1}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(text)
    return p


def test_link_resolution_explicit_then_regions_then_default(tmp_path):
    c = load_cluster(write(tmp_path, BASE))
    assert [n.name for n in c.nodes] == ["a", "b", "c"]
    assert c.node("b").num_gpus == 2 and c.node("b").nic_gbps == 5.0
    assert c.node("c").memory_gb == 12.5
    assert c.link("a", "c") == LinkSpec(100.0, 0.1)  # explicit
    assert c.link("c", "a") is None  # explicit 0 = no link, wins over the default
    assert c.link("a", "b") == LinkSpec(0.5, 40.0)  # between regions, symmetric
    assert c.link("b", "c") == LinkSpec(0.5, 40.0)
    assert c.link("coordinator", "a") == LinkSpec(8.0, 1.0)  # same region: default
    assert c.link("coordinator", "b") == LinkSpec(2.0, 3.0)
    assert c.link("b", "coordinator") == LinkSpec(0.5, 40.0)
    # the NIC caps the usable bandwidth of b's links
    assert c.effective_bandwidth_gbps("coordinator", "b") == 2.0
    assert c.effective_bandwidth_gbps("b", "c") == 0.5


def test_shared_clusters_parse_all_explicit_links():
    for name in ("helix-single-24", "helix-geo-24"):
        c = load_cluster(SHARED / "clusters" / f"{name}.yaml")
        assert len(c.nodes) == 24
        assert len(c.explicit) == 600
        assert c.link("n0", "n1") is not None
    geo = load_cluster(SHARED / "clusters" / "helix-geo-24.yaml")
    assert geo.link("n0", "n20").bandwidth_gbps < 0.2  # cross-region
    assert geo.link("n0", "n1").bandwidth_gbps > 8.0


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("{name: c, gpu: L4, region: r1, memory_gb: 12.5}", "{name: a, gpu: L4}",
         r"nodes\[2\]\.name: duplicate node name 'a'"),
        ("gpu: T4, num_gpus: 2", "gpu: A1000, num_gpus: 2",
         r"nodes\[1\]\.gpu: unknown GPU 'A1000'; known: A10, A100-40GB, .*T4"),
        ("{src: a, dst: c, bandwidth_gbps: 100", "{src: a, dst: c, bandwidth_gbps: -1",
         r"links\.explicit\[0\]\.bandwidth_gbps: bad value -1"),
        ("default: {bandwidth_gbps: 8.0", "default: {bandwidth_gbps: -8.0",
         r"links\.default\.bandwidth_gbps: bad value -8\.0"),
        ("{src: c, dst: a,", "{src: c, dst: zz,", r"links\.explicit\[1\]\.dst: unknown node 'zz'"),
        ("num_gpus: 2", "num_gpus: 0", r"nodes\[1\]\.num_gpus: bad value 0"),
        ("memory_gb: 12.5", "memory_gb: -1", r"nodes\[2\]\.memory_gb: bad value -1"),
        ("{name: a, gpu: A100-40GB", "{name: A_1, gpu: A100-40GB", r"nodes\[0\]\.name: bad value"),
        ("region: r1, memory_gb", "regoin: r1, memory_gb",
         r"nodes\[2\]: unknown field 'regoin' \(did you mean 'region'\?\)"),
        # a misspelled required key is named (with the close match), not reported missing
        ("{name: a, gpu: A100-40GB", "{name: a, gpus: A100-40GB",
         r"nodes\[0\]: unknown field 'gpus' \(did you mean 'gpu'\?\)"),
        # non-finite and absurd numbers
        ("memory_gb: 12.5", "memory_gb: .inf", r"nodes\[2\]\.memory_gb: bad value inf"),
        ("memory_gb: 12.5", "memory_gb: 1.0e+300", r"nodes\[2\]\.memory_gb: bad value 1e\+300"),
        ("default: {bandwidth_gbps: 8.0", "default: {bandwidth_gbps: .nan",
         r"links\.default\.bandwidth_gbps: bad value nan"),
        ("latency_ms: 40", "latency_ms: .nan", r"between_regions\[0\]\.latency_ms: bad value nan"),
        ("nic_gbps: 5", "nic_gbps: .nan", r"nodes\[1\]\.nic_gbps: bad value nan"),
        ("num_gpus: 2", "num_gpus: 100000000000000000000000",
         r"nodes\[1\]\.num_gpus: bad value 100000000000000000000000; must be an integer from 1"),
        # unknown keys outside nodes[], wrong types, duplicates, unknown regions
        ("coordinator: {region: r1}", "coordinator: {regoin: r1}",
         r"coordinator: unknown field 'regoin' \(did you mean 'region'\?\); known: region, nic_gbps"),
        ("name: t\n", "name: t\nnodez: []\n",
         r"cluster\.yaml: unknown field 'nodez' \(did you mean 'nodes'\?\)"),
        ("  explicit:", "  explicitt:", r"links: unknown field 'explicitt'"),
        ("latency_ms: 1.0}", "latency_ms: 1.0, jitter: 2}",
         r"links\.default: unknown field 'jitter'; known"),  # no close match, no hint
        ("name: t\n", "name: [a]\n", r"cluster\.yaml: name: bad value \['a'\]"),
        ("{src: c, dst: a, bandwidth_gbps: 0}",
         "{src: a, dst: c, bandwidth_gbps: 0}", r"links\.explicit\[1\]: a second link a -> c"),
        ("{a: r1, b: r2,", "{a: r1, b: r3,",
         r"between_regions\[0\]\.b: no node or coordinator is in region 'r3'; regions: r1, r2"),
    ],
)
def test_errors_name_file_field_and_value(tmp_path, old, new, message):
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(UserError, match=message) as err:
        load_cluster(path)
    assert str(path) in str(err.value)


def test_numbers_yaml_reads_as_text_are_numbers(tmp_path):
    # YAML 1.1 reads 1e3 (no dot) as the string '1e3'; it is still the number 1000
    c = load_cluster(write(tmp_path, BASE.replace("bandwidth_gbps: 100", "bandwidth_gbps: 1e2")))
    assert c.link("a", "c") == LinkSpec(100.0, 0.1)


def test_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"name: t\xe9\n" + BASE.split("\n", 2)[2].encode())
    with pytest.raises(UserError, match=r"cluster\.yaml: cannot read cluster file: not UTF-8 "
                                        r"text \(byte 0xe9 at offset 7\)"):
        load_cluster(path)


def test_bad_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "name: x\nnodes:\n  - {name: a, gpu: L4\n")
    with pytest.raises(UserError, match=r"cluster\.yaml: bad YAML at line \d+"):
        load_cluster(path)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="cannot read cluster file"):
        load_cluster(tmp_path / "nope.yaml")

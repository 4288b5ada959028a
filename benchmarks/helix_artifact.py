"""Convert clusters and placements of the Helix ASPLOS'25 artifact to helixserve's formats.

The Helix authors published their clusters as `.ini` files (`FakeClusterGenerator` output:
`[ComputeNode-i]` sections with a machine type, `[Link-a-b]` sections with bandwidth and
latency) and their Gurobi placements as `ilp_sol.ini` (`[Settings] offset`, then
`compute_node_<k> = [layers]`). This script turns a checkout of that artifact
(GitHub `Thesys-lab/Helix-ASPLOS25`, Apache-2.0; not needed at run time, nothing is
downloaded) into cluster YAML and placement JSON as docs/formats.md defines
them, so that `helixserve evaluate` scores the authors' placements next to ours
(`benchmarks/helix_compare.py`). The converted files are committed under
`benchmarks/helix-clusters/` and `benchmarks/helix-placements/`.

Conventions, the same as `examples/README.md` states for the two shared clusters:

- units: Helix writes bandwidth as `x * mbps` with `mbps` = 10^6 **bytes**/s (likewise
  `kbps`, `gbps`) and latency as `x * MilliSec`; the YAML has Gbit/s and ms, so
  `1000 * mbps` = 8.0 Gbit/s;
- node `ComputeNode-i` becomes `n<i>`; machine types map A100 -> A100-40GB,
  V100 -> V100-16GB, `L4xN` / `T4xN` -> `num_gpus: N`;
- a compute-compute `[Link-a-b]` is bidirectional in Helix and becomes two directed
  entries; `Link-source-i` is `coordinator -> n<i>`, `Link-i-sink` is `n<i> -> coordinator`;
  `links.default` is 0, so the graph is exactly the `.ini`'s;
- regions: the header's `partition-r: [...]` lists, in node order, when present (then the
  coordinator gets its own `region-host`, as Helix draws its links from the cross-partition
  distribution); otherwise every node and the coordinator are in `region-0`;
- NICs from `machine_profiles.ini` (`inbound`/`outbound_nic_speed`, the smaller of the two).

Usage:
    python -m benchmarks.helix_artifact cluster ARTIFACT/.../cluster42.ini \\
        --profiles ARTIFACT/.../machine_profiles.ini --name helix-mix-42 --out C.yaml
    python -m benchmarks.helix_artifact placement ARTIFACT/.../ilp_sol.ini \\
        --cluster C.yaml --model examples/models/llama-2-70b --out P.json
"""

from __future__ import annotations

import argparse
import ast
import configparser
import json
import re
import sys
from pathlib import Path

from helixserve.errors import UserError
from helixserve.planner.placement import NodeRange, Placement
from helixserve.spec import load_cluster, load_model

#: bytes per second of one Helix bandwidth unit
BANDWIDTH_UNITS = {"bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
#: seconds of one Helix latency unit
LATENCY_UNITS = {"millisec": 1e-3, "sec": 1.0, "microsec": 1e-6}
#: Helix machine type (without the xN suffix) -> GPU catalog name
GPU_NAMES = {"A100": "A100-40GB", "V100": "V100-16GB", "L4": "L4", "T4": "T4"}


def _quantity(text: str, units: dict[str, float], where: str) -> float:
    """`'12.5 * mbps'` -> 12.5e6 (in the unit table's base unit)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*\*\s*([A-Za-z]+)\s*", text)
    if not match or match.group(2).lower() not in units:
        raise UserError(f"{where}: cannot read {text!r} (expected '<number> * <unit>', "
                        f"unit one of {', '.join(sorted(units))})")
    return float(match.group(1)) * units[match.group(2).lower()]


def machine_type(helix_type: str, where: str) -> tuple[str, int]:
    """`'T4x4'` -> (`'T4'`, 4); `'A100'` -> (`'A100-40GB'`, 1)."""
    base, _, count = helix_type.partition("x")
    if base not in GPU_NAMES or (count and not count.isdigit()):
        raise UserError(f"{where}: unknown Helix machine type {helix_type!r} "
                        f"(known: {', '.join(GPU_NAMES)}, optionally with xN)")
    return GPU_NAMES[base], int(count) if count else 1


def _read_ini(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    try:
        parser.read_string(path.read_text(), source=str(path))
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        why = " ".join(str(exc).split())
        raise UserError(f"{path}: cannot read it as a Helix .ini file: {why}") from None
    return parser


def _partitions(path: Path, num_nodes: int) -> list[str] | None:
    """Region of each node from the header's `partition-r: [...]` lines, or None."""
    regions: list[str] = []
    for line in path.read_text().splitlines():
        match = re.match(r"#\s*partition-(\d+):\s*(\[.*\])", line)
        if match:
            regions += [f"region-{match.group(1)}"] * len(ast.literal_eval(match.group(2)))
    if not regions:
        return None
    if len(regions) != num_nodes:
        raise UserError(f"{path}: header partitions list {len(regions)} nodes, "
                        f"the file has {num_nodes}")
    return regions


def _nic_gbps(profiles: configparser.ConfigParser | None, section: str) -> float | None:
    if profiles is None or not profiles.has_section(section):
        return None
    speeds = [_quantity(profiles[section][key], BANDWIDTH_UNITS, f"[{section}] {key}")
              for key in ("inbound_nic_speed", "outbound_nic_speed")
              if profiles[section].get(key, "-1").strip() != "-1"]
    return min(speeds) * 8 / 1e9 if speeds else None


def _fmt(value: float) -> str:
    return f"{round(value, 6):g}"


def convert_cluster(ini: Path, name: str, profiles_ini: Path | None = None) -> str:
    """The cluster YAML text for a Helix cluster `.ini`."""
    cfg = _read_ini(ini)
    profiles = _read_ini(profiles_ini) if profiles_ini else None
    node_sections = sorted((s for s in cfg.sections() if s.startswith("ComputeNode-")),
                           key=lambda s: int(s.split("-")[1]))
    count = len(node_sections)
    if [int(s.split("-")[1]) for s in node_sections] != list(range(count)):
        raise UserError(f"{ini}: ComputeNode sections are not numbered 0..{count - 1}")
    regions = _partitions(ini, count)
    lines = [f"# {name}: converted from the Helix ASPLOS'25 artifact by benchmarks/helix_artifact.py.",
             f"# Source: {ini.name} (Thesys-lab/Helix-ASPLOS25, Apache-2.0)"
             + (f" + {profiles_ini.name} (NIC speeds)." if profiles_ini else "."),
             "# Units: Helix's 'x * mbps' is 1e6 BYTES/s, so '1000 * mbps' = 8.0 Gbit/s.",
             "# ComputeNode-i is n<i>; every [Link-a-b] is listed below, default 0 = no link.",
             "", f"name: {name}", "nodes:"]
    for i, section in enumerate(node_sections):
        helix_type = cfg[section]["type"].strip().strip("'\"")
        gpu, num = machine_type(helix_type, f"{ini}: [{section}] type")
        region = regions[i] if regions else "region-0"
        nic = _nic_gbps(profiles, helix_type)
        entry = f"  - {{name: n{i}, gpu: {gpu}, num_gpus: {num}, region: {region}"
        lines.append(entry + (f", nic_gbps: {_fmt(nic)}}}" if nic is not None else "}"))
    lines += ["links:", "  default: {bandwidth_gbps: 0.0}   # no link unless listed below",
              "  explicit:"]

    def endpoint(token: str, where: str) -> str:
        if token in ("source", "sink"):
            return "coordinator"
        if not token.isdigit() or int(token) >= count:
            raise UserError(f"{where}: unknown endpoint {token!r}")
        return f"n{token}"

    for section in cfg.sections():
        match = re.fullmatch(r"Link-(\w+)-(\w+)", section)
        if not match:
            continue
        where = f"{ini}: [{section}]"
        gbps = _quantity(cfg[section]["bandwidth"], BANDWIDTH_UNITS, where + " bandwidth") * 8 / 1e9
        ms = _quantity(cfg[section]["latency"], LATENCY_UNITS, where + " latency") * 1e3
        src, dst = endpoint(match.group(1), where), endpoint(match.group(2), where)
        pairs = [(src, dst)] if "coordinator" in (src, dst) else [(src, dst), (dst, src)]
        for a, b in pairs:
            lines.append(f"    - {{src: {a}, dst: {b}, bandwidth_gbps: {_fmt(gbps)}, "
                         f"latency_ms: {_fmt(ms)}}}")
    lines.append("coordinator:")
    lines.append(f"  region: {'region-host' if regions else 'region-0'}")
    nic = _nic_gbps(profiles, "SourceNode")
    if nic is not None:
        lines.append(f"  nic_gbps: {_fmt(nic)}")
    return "\n".join(lines) + "\n"


def convert_placement(sol: Path, cluster_yaml: Path, model_path: Path) -> Placement:
    """A Helix `ilp_sol.ini` (layers per `compute_node_<k>`) as a Placement on the converted cluster."""
    cfg = _read_ini(sol)
    offset = int(cfg["Settings"].get("offset", "0")) if cfg.has_section("Settings") else 0
    cluster = load_cluster(cluster_yaml)
    model = load_model(model_path)
    names = {n.name for n in cluster.nodes}
    nodes: list[NodeRange] = []
    if not cfg.has_section("Solution"):
        raise UserError(f"{sol}: no [Solution] section (expected a Helix ilp_sol.ini)")
    for key, value in cfg["Solution"].items():
        where = f"{sol}: [Solution] {key}"
        match = re.fullmatch(r"compute_node_(\d+)", key)
        if not match:
            raise UserError(f"{where}: expected compute_node_<k>")
        name = f"n{int(match.group(1)) - offset}"
        if name not in names:
            raise UserError(f"{where}: {name} is not a node of {cluster_yaml}")
        layers = sorted(ast.literal_eval(value))
        if not layers or layers != list(range(layers[0], layers[-1] + 1)):
            raise UserError(f"{where}: layers {value} are not one contiguous range")
        nodes.append(NodeRange(name, layers[0], layers[-1] + 1))
    placement = Placement(model=model.name, cluster=cluster.name, num_layers=model.num_layers,
                          planner="helix-gurobi", nodes=nodes)
    placement.validate(str(sol))
    if not placement.covers_all_layers():
        held = {layer for n in nodes for layer in range(n.start_layer, n.end_layer)}
        missing = [layer for layer in range(model.num_layers) if layer not in held]
        raise UserError(f"{sol}: no node holds layers {missing[0]}..{missing[-1]} of "
                        f"{model.name!r} ({model.num_layers} layers): a placement for another model?")
    return placement


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cluster", help="a Helix cluster .ini -> cluster YAML")
    c.add_argument("ini", type=Path)
    c.add_argument("--profiles", type=Path, help="Helix machine_profiles.ini (NIC speeds)")
    c.add_argument("--name", required=True)
    c.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("placement", help="a Helix ilp_sol.ini -> placement JSON")
    p.add_argument("sol", type=Path)
    p.add_argument("--cluster", type=Path, required=True, help="the converted cluster YAML")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--source", default="", help="where the .ini came from, kept in the JSON")
    p.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        if args.what == "cluster":
            args.out.write_text(convert_cluster(args.ini, args.name, args.profiles))
            load_cluster(args.out)  # the result must load
        else:
            placement = convert_placement(args.sol, args.cluster, args.model)
            data = placement.to_dict()
            if args.source:
                data["source"] = args.source
            args.out.write_text(json.dumps(data, indent=1) + "\n")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

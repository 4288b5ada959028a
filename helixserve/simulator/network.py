"""Links and NICs of the simulated cluster: when does a transfer arrive?

A transfer of `nbytes` from `src` to `dst` holds the directed link, the sender's NIC egress
and the receiver's NIC ingress, each for `nbytes / its bandwidth`, starting when all three
are free: one transfer at a time per direction, in the order they were sent (FIFO). It
arrives one link latency after the slowest of the three is done. Each resource is a
"free at" cursor, so a transfer costs O(1) and needs no events of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from helixserve.errors import UserError
from helixserve.spec import ClusterSpec


@dataclass
class SimLink:
    src: str
    dst: str
    bytes_per_s: float
    latency_s: float
    free_at_s: float = 0.0
    #: time spent serialising bytes onto the link
    busy_s: float = 0.0
    bytes_sent: int = 0


class Network:
    def __init__(self, cluster: ClusterSpec, endpoints: list[str]) -> None:
        self.cluster = cluster
        self.links: dict[tuple[str, str], SimLink] = {}
        #: NIC bytes/s (None: unlimited) and when egress / ingress are free next
        self.nic_bps: dict[str, float | None] = {}
        self.nic_out_free: dict[str, float] = {}
        self.nic_in_free: dict[str, float] = {}
        for name in endpoints:
            gbps = cluster.nic_gbps_of(name)
            self.nic_bps[name] = gbps * 1e9 / 8 if gbps else None
            self.nic_out_free[name] = self.nic_in_free[name] = 0.0

    def _link(self, src: str, dst: str) -> SimLink:
        spec = self.cluster.link(src, dst)
        if spec is None:
            raise UserError(
                f"route uses {src} -> {dst} but the cluster has no link there; the placement's "
                "flows do not match the cluster"
            )
        link = SimLink(src, dst, spec.bandwidth_gbps * 1e9 / 8, spec.latency_ms / 1000.0)
        self.links[src, dst] = link
        return link

    def send(self, now_s: float, src: str, dst: str, nbytes: int) -> float:
        """Reserve the link and NICs for a transfer sent at `now_s`; return its arrival time."""
        link = self.links.get((src, dst)) or self._link(src, dst)
        busy_s = nbytes / link.bytes_per_s
        start = max(now_s, link.free_at_s)
        out_bps, in_bps = self.nic_bps[src], self.nic_bps[dst]
        out_s = nbytes / out_bps if out_bps else 0.0
        in_s = nbytes / in_bps if in_bps else 0.0
        if out_bps:
            start = max(start, self.nic_out_free[src])
        if in_bps:
            start = max(start, self.nic_in_free[dst])
        link.free_at_s = start + busy_s
        link.busy_s += busy_s
        link.bytes_sent += nbytes
        if out_bps:
            self.nic_out_free[src] = start + out_s
        if in_bps:
            self.nic_in_free[dst] = start + in_s
        return start + max(busy_s, out_s, in_s) + link.latency_s

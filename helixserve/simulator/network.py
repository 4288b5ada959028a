"""Links and NICs of the simulated cluster: when does a transfer arrive?

A transfer of `nbytes` from `src` to `dst` holds the directed link, the sender's NIC egress
and the receiver's NIC ingress, each for `nbytes / its bandwidth`: one transfer at a time
per link direction and per NIC direction, each in the order they were handed over (FIFO).
A NIC takes the transfer when it is handed over (or when the NIC is free), whatever the
link's queue: a NIC feeds all of a node's links, so a transfer waiting behind one slow
link's queue must not hold the NIC, and the node's other links, until its turn there. The
link starts the transfer once it is free and both NICs have started it. It arrives one link
latency after the last of the three is done. Each resource is a "free at" cursor, so a
transfer costs O(1) and needs no events of its own.

(Before 2026-12-06 the NICs' cursors moved to the link's start: on helix-geo-24 a node
with six 0.1 Gbit/s links out carried about a third of what they can, and the rehearsal of
the same placement, whose links are independent, measured up to 5x the simulator's prompt
tokens/s in the first minute; docs/rehearse.md.)
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
        out_bps, in_bps = self.nic_bps[src], self.nic_bps[dst]
        out_start = in_start = now_s
        out_s = in_s = 0.0
        if out_bps:
            out_start = max(now_s, self.nic_out_free[src])
            out_s = nbytes / out_bps
            self.nic_out_free[src] = out_start + out_s
        if in_bps:
            in_start = max(now_s, self.nic_in_free[dst])
            in_s = nbytes / in_bps
            self.nic_in_free[dst] = in_start + in_s
        start = max(link.free_at_s, out_start, in_start)
        link.free_at_s = start + busy_s
        link.busy_s += busy_s
        link.bytes_sent += nbytes
        return max(start + busy_s, out_start + out_s, in_start + in_s) + link.latency_s

"""TEMP contract shim (pe-core owns the real one): per node, the prefix block names it holds."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from helixserve.prefix import BlockHash, CacheEvents


class PrefixIndex:
    def __init__(self) -> None:
        self.nodes: dict[str, set[BlockHash]] = {}

    def apply(self, node: str, events: CacheEvents) -> None:
        held = self.nodes.setdefault(node, set())
        if events.reset:
            held.clear()
        held.difference_update(events.removed)
        held.update(events.stored)

    def forget(self, node: str) -> None:
        self.nodes.pop(node, None)

    def drop(self, node: str, names: Iterable[BlockHash]) -> None:
        self.nodes.get(node, set()).difference_update(names)

    def matched_blocks(self, node: str, names: Sequence[BlockHash]) -> int:
        held = self.nodes.get(node, set())
        n = 0
        for h in names:
            if h not in held:
                break
            n += 1
        return n

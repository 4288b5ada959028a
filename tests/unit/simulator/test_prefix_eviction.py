"""The simulated prefix cache evicts as the engines do (engine/kv_blocks.py `free`, vLLM's
block pool): a finished request's blocks join the LRU last block first, so under pressure a
prefix loses its tail and keeps its head, which every later block's match needs."""

from __future__ import annotations

from helixserve.prefix import block_hashes
from helixserve.simulator.prefix import NodeCache


def test_a_released_prefix_loses_its_tail_first() -> None:
    names = block_hashes(list(range(24)), 4, 0, 4)  # 6 blocks
    c = NodeCache()
    c.use(names)
    c.release(names)
    c.trim(4)
    # the head 4 blocks still match; evicting head first would leave a match of 0
    assert c.matched(names) == 4
    assert sorted(c.log.take().removed) == sorted(names[4:])


def test_blocks_of_an_older_request_go_before_a_newer_ones() -> None:
    a = block_hashes(list(range(8)), 4, 0, 4)
    b = block_hashes(list(range(100, 108)), 4, 0, 4)
    c = NodeCache()
    c.use(a)
    c.use(b)
    c.release(a)
    c.release(b)
    c.trim(2)  # a's tail, then a's head
    assert c.matched(a) == 0 and c.matched(b) == 2
    c.trim(1)
    assert c.matched(b) == 1

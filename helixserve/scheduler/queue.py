"""The admission queue: which waiting request may be admitted next.

Rule (the same in the simulator and the coordinator): first come, first served with
head-of-line blocking (only the head is offered to the router; while it finds no route,
nobody behind it is admitted, so a large request is never starved by small ones), and a
request preempted by recompute goes back to the head, ahead of every new request (the most
recently preempted first), as vLLM's scheduler requeues it. Admission is retried when a
request arrives at an empty queue, when a request finishes, and when nothing is running.
"""

from __future__ import annotations

from collections import deque
from typing import TypeVar

T = TypeVar("T")


class AdmissionQueue(deque[T]):
    """A deque of waiting requests (any type: the simulator's requests, the coordinator's
    request ids) with the admission rule's operations; oldest at the left."""

    def arrive(self, item: T) -> None:
        """A new request waits behind every one already waiting."""
        self.append(item)

    def requeue_preempted(self, item: T) -> None:
        """A preempted request waits ahead of every one already waiting."""
        self.appendleft(item)

    def may_admit(self, item: T) -> bool:
        """Whether `item` is the one the router may be offered now (the head)."""
        return bool(self) and self[0] == item

    def admitted(self) -> T:
        """The head was admitted (or given up): it leaves the queue."""
        return self.popleft()

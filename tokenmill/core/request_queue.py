"""The waiting queue's order: first come first served, or by priority (vLLM's `--scheduling-policy`).

Priority (lower is served first) with aging, so no request starves: a request's rank is

    effective priority = priority - (seconds it has waited) / priority_aging

and since every request's wait grows at the same rate, comparing ranks at any moment is comparing
`priority + arrival_time / priority_aging` (a key fixed at arrival; ties by arrival). Hence a request
of priority p is overtaken only by requests of priority q < p that arrive less than
(p - q) x priority_aging seconds after it: after that long, nothing new can pass it. With
priority_aging = 0, priorities are strict (ties by arrival, as vLLM) and starvation is unbounded.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from tokenmill.core.request import Request


def priority_key(req: Request, aging: float) -> tuple[float, float]:
    """The rank of a request (lower runs first; lower is also kept when preempting)."""
    if aging > 0:
        return req.priority + req.arrival_time / aging, req.arrival_time
    return float(req.priority), req.arrival_time


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self):
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_preempted(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """By `priority_key`; a preempted request returns to its rank (it keeps its arrival time)."""

    def __init__(self, aging: float):
        self.aging = aging
        self._heap: list[tuple[tuple[float, float], int, Request]] = []
        self._seq = 0  # ties after the key: insertion order, and no comparing Requests

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (priority_key(req, self.aging), self._seq, req))
        self._seq += 1

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap))


def make_queue(policy: str, aging: float) -> FCFSQueue | PriorityQueue:
    return PriorityQueue(aging) if policy == "priority" else FCFSQueue()


def running_order(req: Request, policy: str, aging: float):
    """Running requests are served decode first, then prefill; by rank within each under priority."""
    if policy == "priority":
        return req.is_prefilling, priority_key(req, aging)
    return req.is_prefilling


def preemption_victim(running: list[Request], scheduled: dict[str, int], policy: str, aging: float) -> Request:
    """fcfs: the most recently admitted request not yet in this step's batch; priority: the
    lowest-ranked running request (its part of the step, if any, is then undone)."""
    if policy == "priority":
        return max(running, key=lambda r: priority_key(r, aging))
    return next(r for r in reversed(running) if r.request_id not in scheduled)

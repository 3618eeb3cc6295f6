"""Failure detection of nodes without all-to-all polling: each agent watches
the leases of the next few nodes on a ring, so a check costs an agent O(k)
store requests whatever the number of nodes.

An agent watches its ``k`` nearest successors that are neither dead nor done,
reading only the nodes in that window; a dead or finished one is passed over,
so when a neighbour dies its watchers reach on to the neighbour's neighbours.
A node is therefore watched by its ``k`` nearest live predecessors: up to
``k - 1`` of them may fail with it and it is still declared. A node's death
is declared once: whoever wins the compare-and-set of its dead flag reports
it, and the others see the flag.

A lease's standing still counts only while its watcher reaches the store: when
a watcher's checks are more than half the timeout apart (its own calls waited
for a store that did not answer, an etcd election say) it starts every timer
again. A store outage shorter than the agents' bound then declares no node
lost, however long it is next to the lease timeout.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import KeyValueStore

WATCHED = 2  # successors watched on the ring: two adjacent nodes may fail together


def ring_window(node: int, nnodes: int, gone: Callable[[int], bool], k: int = WATCHED) -> Tuple[List[int], List[int]]:
    """(the k nearest successors of ``node`` for which ``gone`` is False, the ones passed
    over on the way). Each successor is looked at once, in ring order."""
    watched: List[int] = []
    passed: List[int] = []
    for step in range(1, nnodes):
        other = (node + step) % nnodes
        if len(watched) == k:
            break
        (passed if gone(other) else watched).append(other)
    return watched, passed


class LeaseWatch:
    """This agent's watch of its ring window (``check`` once per watch interval)."""

    def __init__(self, kv: KeyValueStore, coordinator: Coordinator, node: int, nnodes: int, timeout: float,
                 me: str) -> None:
        self._kv = kv
        self._coordinator = coordinator
        self.node = node
        self.nnodes = nnodes
        self.timeout = timeout
        self._me = me
        self._seen: Dict[int, Tuple[Optional[int], float]] = {}  # node -> (lease, when it last moved)
        self._gone: Dict[int, bool] = {}  # nodes seen dead or done: never watched again
        self._last_check: Optional[float] = None

    def check(self, now: float) -> List[Tuple[int, float]]:
        """The nodes this agent declared lost in this check, each with how long its
        lease had stood still. Reads the window's leases (one request each); a lease
        that stood still past the timeout costs one more read, of its dead and done
        flags (a finished or already declared node is passed over from then on)."""
        declared: List[Tuple[int, float]] = []
        if self._last_check is not None and now - self._last_check > self.timeout / 2:
            self._seen = {other: (lease, now) for other, (lease, _) in self._seen.items()}
        self._last_check = now
        watched, _ = ring_window(self.node, self.nnodes, lambda other: self._gone.get(other, False))
        for other in watched:
            lease = self._kv.add(keys.node_lease(other), 0)
            if lease == 0:
                continue  # not started yet
            seen, seen_at = self._seen.get(other, (None, now))
            if lease != seen:
                self._seen[other] = (lease, now)
                continue
            if now - seen_at <= self.timeout:
                continue
            self._gone[other] = True
            dead, done = self._kv.get_many([keys.node_dead(other), keys.node_done(other)])
            if not dead and not done and self._coordinator.declare_node_dead(other, self._me):
                declared.append((other, now - seen_at))
        return declared

"""Ring lease watching: which nodes an agent reads, and that every lost node is
declared once, within the lease timeout, when neighbours die together. Over
the in-memory store (the logic) and a real TCPStore (the request count)."""

import pytest

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.control.leases import LeaseWatch, ring_window


def test_an_agent_watches_its_two_nearest_live_successors():
    assert ring_window(3, 8, lambda n: False) == ([4, 5], [])
    assert ring_window(7, 8, lambda n: False) == ([0, 1], [])
    assert ring_window(3, 8, lambda n: n in (4, 6)) == ([5, 7], [4, 6])  # the dead are passed over
    assert ring_window(0, 2, lambda n: False) == ([1], [])
    assert ring_window(0, 1, lambda n: False) == ([], [])


def test_what_an_agent_reads_does_not_grow_with_the_job():
    looked = []
    ring_window(10, 2048, lambda n: looked.append(n) or False)
    assert looked == [11, 12]


class Ring:
    """N agents' lease watches over one store; each alive agent bumps its lease."""

    def __init__(self, nnodes, timeout=1.0):
        self.kv = InMemoryKeyValueStore()
        coordinator = Coordinator(self.kv)
        self.watches = [LeaseWatch(self.kv.clone(), coordinator, n, nnodes, timeout, f"agent{n}") for n in range(nnodes)]
        self.alive = set(range(nnodes))
        self.declared = []

    def tick(self, now):
        for n in sorted(self.alive):
            self.kv.add(keys.node_lease(n), 1)
        for n in sorted(self.alive):
            self.declared += [(n, lost) for lost, _ in self.watches[n].check(now)]


@pytest.mark.parametrize("lost", [{5}, {5, 6}, {7, 0}], ids=["one", "two neighbours", "two across the wrap"])
def test_lost_nodes_are_declared_once_each_within_the_timeout(lost):
    ring = Ring(8, timeout=1.0)
    now = 0.0
    for _ in range(5):  # everyone sees everyone's lease move
        ring.tick(now)
        now += 0.1
    ring.alive -= lost
    died = now
    while now < died + 3.0:
        ring.tick(now)
        now += 0.1
    assert sorted(node for _, node in ring.declared) == sorted(lost)  # each once
    for node in lost:
        assert ring.kv.get(keys.node_dead(node)) is not None
    # declared by a live predecessor, 1 s (the timeout) plus one check after they stopped
    assert all(watcher in ring.alive for watcher, _ in ring.declared)


def test_a_finished_node_is_not_declared_lost():
    ring = Ring(4, timeout=0.5)
    for step in range(5):
        ring.tick(step * 0.1)
    ring.kv.set(keys.node_done(2), b"1")
    ring.alive.discard(2)
    for step in range(5, 30):
        ring.tick(step * 0.1)
    assert ring.declared == []


def test_a_store_outage_longer_than_the_lease_timeout_declares_no_node():
    # Every agent's calls waited 2.5 s for the store (an etcd election): no lease moved
    # meanwhile, and the watchers' first checks after it run before the others' leases
    # move again. None of the nodes is lost.
    ring = Ring(4, timeout=1.0)
    for step in range(5):
        ring.tick(step * 0.1)
    for n in sorted(ring.alive):
        ring.declared += [(n, lost) for lost, _ in ring.watches[n].check(3.0)]
    for step in range(31, 40):
        ring.tick(step * 0.1)
    assert ring.declared == []
    # a node lost after it still is, within the timeout and a check
    ring.alive.discard(2)
    for step in range(40, 80):
        ring.tick(step * 0.1)
    assert [node for _, node in ring.declared] == [2]


def test_a_check_costs_a_few_store_requests_at_any_size():
    from peerstate.control.kvstore import TorchKeyValueStore

    for nnodes in (4, 512):
        kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
        for n in range(nnodes):
            kv.add(keys.node_lease(n), 1)
        watch = LeaseWatch(kv, Coordinator(kv), 1, nnodes, 3.0, "agent1")
        before = kv.count.requests
        watch.check(0.0)
        assert kv.count.requests - before == 2  # the leases of two successors, one request each
        watch.check(1.4)
        watch.check(2.8)
        before = kv.count.requests
        watch.check(4.2)  # both stood still past the timeout: their flags are read, both declared
        # leases; the two absent flags of each (a check of both, then one each); compare_set + append each
        assert kv.count.requests - before == 2 + 2 * 3 + 2 * 2

"""Ring lease watching: which nodes an agent reads, and that every lost node is
declared once, within the lease timeout, when neighbours die together. Over
the in-memory store (the logic), a real TCPStore (the request count), and
agent processes on a TCPStore, two of them killed together."""

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


# One node's agent as far as leases go, in a process of its own: it renews its lease and
# checks its ring window every 0.1 s (the agent's watch tick), noting in the store each node
# it declares lost and when.
_LEASE_AGENT = """
import sys, time
from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import TorchKeyValueStore
from peerstate.control.leases import LeaseWatch
from peerstate.control import keys
port, node, nnodes, timeout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
kv = TorchKeyValueStore("127.0.0.1", port, timeout=30)
watch = LeaseWatch(kv, Coordinator(kv), node, nnodes, timeout, f"agent{node}")
while True:
    kv.add(keys.node_lease(node), 1)
    for lost, _ in watch.check(time.monotonic()):
        kv.append("test/declared", f"{node}:{lost}:{time.time()!r},".encode())
    time.sleep(0.1)
"""


@pytest.mark.e2e
def test_two_neighbouring_agents_killed_together_are_each_declared_once_by_a_live_one():
    # The ring on a real store with real processes: agents 2 and 3 are SIGKILLed at
    # once; agent 1 watches both, agent 0 watches 2 and then reaches on to 3. Each is
    # declared exactly once, by a live agent, within the lease timeout plus a few
    # checks, and no live agent is declared.
    import signal
    import subprocess
    import sys
    import time

    from peerstate.control.kvstore import TorchKeyValueStore

    nnodes, timeout = 6, 1.0
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    agents = [subprocess.Popen([sys.executable, "-c", _LEASE_AGENT, str(kv.port), str(n), str(nnodes), str(timeout)])
              for n in range(nnodes)]
    try:
        deadline = time.monotonic() + 60
        while min(kv.add(keys.node_lease(n), 0) for n in range(nnodes)) < 5:  # every agent has seen every lease move
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the agents did not start"
            time.sleep(0.1)
        killed_at = time.time()
        for node in (2, 3):
            agents[node].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kv.get(keys.node_dead(2)) is None or kv.get(keys.node_dead(3)) is None:
            assert time.monotonic() < deadline, f"declared so far: {kv.get('test/declared')}"
            time.sleep(0.1)
        time.sleep(2 * timeout)  # long enough for a second declaration, or a live node's, to show
        declared = [entry.split(":") for entry in kv.get("test/declared").decode().rstrip(",").split(",")]
        assert sorted(int(lost) for _, lost, _ in declared) == [2, 3]
        assert all(int(watcher) in (0, 1, 4, 5) for watcher, _, _ in declared)
        assert all(float(at) - killed_at < timeout + 1.0 for _, _, at in declared)
        assert sorted(kv.get(keys.DEAD_NODES).decode().rstrip(",").split(",")) == ["2", "3"]
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()

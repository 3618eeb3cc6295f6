"""The recovery protocol through node agents over a real TCPStore: simulated
nodes (peerstate.tools.simulation) run the agents' real NodeRelay,
InstructionWriter and Coordinator; a plan writer is killed with SIGKILL in its
own process; nodes fail together; a node's report comes after the writer's
deadline."""

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("torch")

from peerstate.control import keys  # noqa: E402
from peerstate.control.coordinator import Coordinator  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.control.messages import (MemberReport, NodeInstructions, RecoveryPlan, RestoreSource,  # noqa: E402
                                        StateLayout)
from peerstate.control.planning import expand  # noqa: E402
from peerstate.tools.simulation import SimulatedNode, served_by  # noqa: E402

NPROC = 2
WRITER_SCRIPT = Path(__file__).parents[1] / "helpers" / "dying_writer.py"


@pytest.fixture
def store():
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    return kv, f"127.0.0.1:{kv.port}"


LAYOUT = StateLayout(k=1, share_count=NPROC, data_parallel=True)  # each node keeps one full copy


def start_nodes(address, nnodes, which=None, **options):
    served = served_by(nnodes * NPROC, NPROC, 1)
    which = list(which or range(nnodes))
    with ThreadPoolExecutor(16) as pool:  # a TCPStore client now and then takes seconds to connect: overlap them
        made = pool.map(lambda n: SimulatedNode(address, n, nnodes, NPROC, served, layout=LAYOUT, **options), which)
        nodes = dict(zip(which, made))
    for node in nodes.values():
        node.connect()
    for node in nodes.values():
        node.start()
    return nodes


def stop(nodes):
    for node in nodes.values():
        node.stop(wait=False)
    for node in nodes.values():
        node.stop()


def orders(node, epoch, rank):
    """What ``rank``'s worker makes of its node's instructions (as EpochJoiner does)."""
    node_orders = NodeInstructions.decode(node.channel.get(keys.member_instructions(epoch, node.node)))
    reports = {r: MemberReport.decode(node.channel.get(keys.member_report(epoch, r))) for r in node_orders.members}
    return expand(node_orders, reports, [rank])[rank]


@pytest.mark.e2e
def test_a_recovery_hands_every_member_its_instructions_at_a_cost_per_rank_that_does_not_grow(store):
    costs = {}
    for nnodes in (4, 32):
        kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
        address = f"127.0.0.1:{kv.port}"
        nodes = start_nodes(address, nnodes)
        try:
            for node in nodes.values():
                node.channel.wait_delivered(0, 20)
            before = sum(n.kv.count.requests for n in nodes.values())  # its relay's clone counts there too
            reporter = Coordinator(TorchKeyValueStore("127.0.0.1", kv.port))
            plan = reporter.report_failure(["n1.0"], "killed", detected_at=time.time(), me="agent1")
            for node in nodes.values():
                node.channel.wait_delivered(1, 20)
            after = sum(n.kv.count.requests for n in nodes.values())  # its relay's clone counts there too
            costs[nnodes] = (after - before + reporter.kv.count.requests) / (nnodes * NPROC)
            # rank 2 (n1.0) went to node 1's spare, which pulls from its buddy; everyone else rolls back
            assert plan.replaced == {2: "n1.2"}
            replacement = orders(nodes[1], 1, 2)
            assert replacement.restore.source is RestoreSource.PEERS and replacement.restore.version == 100
            assert replacement.restore.own_sources == [4]  # its buddy: the same local index on the next node
            assert 4 in replacement.addresses
            survivor = orders(nodes[0], 1, 0)
            assert survivor.restore.source is RestoreSource.LOCAL and survivor.restore.version == 100
            # the share it does not snapshot: from its node-mate's memory first, at most 4 sources at any size
            pull = survivor.restore.shares[1]
            assert sorted(survivor.restore.shares) == [1] and pull.sources[0] == 1 and list(pull.same_node) == [1]
            assert len(pull.sources) == min(4, nnodes)
        finally:
            stop(nodes)
    assert costs[32] < 1.25 * costs[4] and costs[32] < 10, costs


def test_a_plan_writer_killed_after_gathering_is_replaced_by_a_newer_epoch(store, tmp_path):
    kv, address = store
    nnodes, writer_node = 4, 2
    child = subprocess.Popen([sys.executable, str(WRITER_SCRIPT), address, str(nnodes), str(writer_node),
                              str(NPROC)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        nodes = start_nodes(address, nnodes, [n for n in range(nnodes) if n != writer_node], lease_timeout=1.0)
        for node in nodes.values():
            node.channel.wait_delivered(0, 20)
        child.stdout.readline()  # the child's node relayed epoch 0 as well
        # rank 5 (n2.1) dies; its agent, the writer, plans epoch 1, gathers every report, then is killed
        reporter = Coordinator(TorchKeyValueStore("127.0.0.1", kv.port))
        reporter.report_failure(["n2.1"], "killed", detected_at=time.time(), me=f"agent{writer_node}")
        assert child.wait(timeout=20) == -signal.SIGKILL
        assert kv.get(keys.node_instructions(1, 0)) is None  # it died before publishing
        # the survivors' ring sees its lease stop, declares node 2 once, and hands its ranks to spares
        deadline = time.monotonic() + 20
        declared = []
        while time.monotonic() < deadline and not declared:
            now = time.monotonic()
            for node in nodes.values():  # the agent's watch tick: its lease, then its ring window
                node.control.tick()
                declared += [(node.node, lost) for lost in node.control.check_leases(now)]
            time.sleep(0.1)
        assert [lost for _, lost in declared] == [writer_node]
        for node in nodes.values():
            node.channel.wait_delivered(2, 20)
        latest = Coordinator(kv).latest_plan()
        assert latest.epoch == 2 and sorted(latest.failed) == [4, 5]
        assert all(not w.startswith(f"n{writer_node}.") for w in latest.members.values())
        assert kv.get(keys.node_instructions(1, 0)) == keys.MOOT  # epoch 1 was moot, never planned
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        stop(locals().get("nodes", {}))


@pytest.mark.e2e
def test_a_silent_owner_whose_node_was_lost_is_taken_over(store):
    kv, address = store
    nodes = start_nodes(address, 4, [0, 1, 2])
    nodes3 = start_nodes(address, 4, [3])  # node 3 starts, then goes silent
    try:
        for node in {**nodes, **nodes3}.values():
            node.channel.wait_delivered(0, 20)
        stop(nodes3)
        # epoch 1 hands node 3's ranks to spares elsewhere; its writer, agent3, is then lost before its
        # instructions: node 3 has no member left, so no newer epoch comes, and a survivor must take over
        coordinator = Coordinator(kv)
        coordinator.declare_node_dead(3, "agent0")
        kv.compare_set(keys.epoch_owner(1), b"", b"agent3")
        for spare in ("n0.2", "n1.2"):
            kv.compare_set(keys.spare_state(spare), b"ready", b"assigned:1:x")
        plan = RecoveryPlan(1, {}, {6: "n0.2", 7: "n1.2"}, [6, 7], "node 3 lost", time.time(), time.time(), "agent3")
        kv.set(keys.epoch_plan(1), plan.encode())
        for node in nodes.values():
            node.channel.wait_delivered(1, 20)
        assert kv.get(keys.epoch_owner(1)) in (b"agent0", b"agent1", b"agent2")
        assert orders(nodes[0], 1, 6).restore.source is RestoreSource.PEERS
    finally:
        stop(nodes)


def test_two_nodes_failing_at_once_are_both_replaced(store):
    kv, address = store
    nnodes = 6
    nodes = start_nodes(address, nnodes)
    try:
        for node in nodes.values():
            node.channel.wait_delivered(0, 20)
        for lost in (2, 4):  # not neighbours: with k=1 a node's buddies are on the next one
            nodes.pop(lost).stop()
        results, errors = [], []

        def declare(lost, me):
            try:
                coordinator = Coordinator(TorchKeyValueStore("127.0.0.1", kv.port))
                if coordinator.declare_node_dead(lost, me):
                    results.append(coordinator.report_failure([f"n{lost}.0", f"n{lost}.1"], "lost",
                                                              detected_at=time.time(), me=me))
            except Exception as error:  # noqa: BLE001
                errors.append(error)

        threads = [threading.Thread(target=declare, args=(lost, f"agent{lost - 1}")) for lost in (2, 4)]
        [t.start() for t in threads]
        [t.join(timeout=30) for t in threads]
        assert not errors
        latest = Coordinator(kv).latest_plan()
        assert sorted(r for p in results for r in p.failed) == [4, 5, 8, 9]
        assert all(not w.startswith(("n2.", "n4.")) for w in latest.members.values())
        for node in nodes.values():
            node.channel.wait_delivered(latest.epoch, 20)
        holders = {r: [n for n in nodes.values() if r in n.channel.members][0] for r in (4, 5, 8, 9)}
        for rank, node in holders.items():
            assert orders(node, latest.epoch, rank).restore.source is RestoreSource.PEERS
    finally:
        stop(nodes)


def test_a_node_report_after_the_writers_deadline_fences_that_node(store):
    kv, address = store
    nodes = start_nodes(address, 4, report_timeout=1.0)
    try:
        for node in nodes.values():
            node.channel.wait_delivered(0, 20)
        late = nodes[3]
        late.stop()  # its agent stalls (its lease would still move): node 3's report never comes
        Coordinator(TorchKeyValueStore("127.0.0.1", kv.port)).report_failure(
            ["n0.0"], "killed", detected_at=time.time(), me="agent0")
        for n in (0, 1, 2):
            nodes[n].channel.wait_delivered(2, 30)
        latest = Coordinator(kv).latest_plan()
        assert kv.get(keys.node_dead(3)) == b"agent0"  # the writer fenced it
        assert latest.epoch == 2 and sorted(latest.failed) == [6, 7]
        assert kv.get(keys.node_instructions(1, 0)) == keys.MOOT  # epoch 1 was never planned with a partial view
        late.start()  # its agent comes back: it finds itself declared lost, and stops
        deadline = time.monotonic() + 10
        while not late.fenced and time.monotonic() < deadline:
            time.sleep(0.05)
        assert late.fenced and late.failures == []
    finally:
        stop(nodes)


def test_relays_waiting_for_a_moot_epochs_instructions_move_on_at_once(store):
    # Epoch 1's owner never writes its instructions; epoch 2's plan makes it moot. The relays
    # look for a lost owner only every 30 s here: they must learn of epoch 2 from the mark its
    # plan's writer leaves in their instructions keys, not by looking.
    kv, address = store
    nodes = start_nodes(address, 4, lease_timeout=30.0)
    try:
        for node in nodes.values():
            node.channel.wait_delivered(0, 20)
        kv.compare_set(keys.epoch_owner(1), b"", b"agent9")
        kv.set(keys.epoch_plan(1), RecoveryPlan(1, reason="silent owner", writer="agent9").encode())
        time.sleep(1.0)  # every relay waits for epoch 1's instructions now
        started = time.monotonic()
        plan = Coordinator(TorchKeyValueStore("127.0.0.1", kv.port)).report_failure(
            ["n1.0"], "killed", detected_at=time.time(), me="agent0")
        assert plan.epoch == 2
        for node in nodes.values():
            node.channel.wait_delivered(2, 20)
        assert time.monotonic() - started < 10, "the relays waited for a look at the store, not for the mark"
        assert all(kv.get(keys.node_instructions(1, n)) == keys.MOOT for n in range(4))
        assert all(node.failures == [] and 1 not in node.channel.delivered for node in nodes.values())
    finally:
        stop(nodes)

"""The coordinator's rules over a real TCPStore: one plan per epoch however many
agents report at once, spares claimed once, and the recovery point."""

import subprocess
import sys
import threading

import pytest

pytest.importorskip("torch")

from peerstate import BuddyPlacement, DataParallelShares, InvalidArgumentError, JobFailedError  # noqa: E402
from peerstate.control import keys  # noqa: E402
from peerstate.control.coordinator import Coordinator, Members  # noqa: E402
from peerstate.control.messages import MemberReport, RecoveryPlan  # noqa: E402
from peerstate.control.planning import recovery_point, share_sources, sources_of  # noqa: E402
from peerstate.replication.placement import default_share_count, mesh_replica_sets  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.control.timeline import EventLog, read_events, recovery_timeline  # noqa: E402

WORLD = 4
MEMBERS = {r: f"n{r // 2}.{r % 2}" for r in range(WORLD)}


@pytest.fixture
def kv():
    return TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)


def coordinator(kv, spares=("n0.2", "n1.2")):
    c = Coordinator(kv)
    kv.set("config", b'{"nnodes": 2, "nproc_per_node": 2, "world_size": 4}')
    c.start("agent0")
    for spare in spares:
        c.register_spare(spare)
    return c


def test_concurrent_reports_of_one_failure_make_one_plan(kv):
    coordinator(kv)
    plans, errors = [], []

    def report(i):
        try:  # each agent has its own connection, as in a real job
            c = Coordinator(kv.clone())
            plans.append(c.report_failure(["n1.0"], "killed", detected_at=1.0, me=f"agent{i}"))
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=report, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert not errors
    made = [p for p in plans if p is not None]
    assert {p.epoch for p in made} == {1}
    latest = Coordinator(kv).latest_plan()
    assert latest.epoch == 1 and latest.failed == [2]
    assert latest.replaced == {2: "n1.2"}  # a spare of the failed worker's own node first
    assert kv.get("spare/n1.2") == b"assigned:1:2" and kv.get("spare/n0.2") == b"ready"  # claimed once


def test_two_failures_at_once_each_get_a_spare_and_an_epoch(kv):
    coordinator(kv)
    results = []
    threads = [threading.Thread(target=lambda w=w, i=i: results.append(
        Coordinator(kv.clone()).report_failure([w], "killed", detected_at=1.0, me=f"agent{i}")))
        for i, w in enumerate(["n0.1", "n1.1"])]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    latest = Coordinator(kv).latest_plan()
    assert latest.epoch == 2
    assert {latest.members[1], latest.members[3]} == {"n0.2", "n1.2"}
    assert sorted(r for p in results if p for r in p.failed) == [1, 3]


def test_a_failure_already_replaced_makes_no_plan(kv):
    c = coordinator(kv)
    assert c.report_failure(["n0.0"], "killed", detected_at=1.0, me="a").epoch == 1
    assert c.report_failure(["n0.0"], "killed again", detected_at=1.0, me="b") is None


def test_no_spare_left_is_a_clear_error(kv):
    c = coordinator(kv, spares=())
    with pytest.raises(JobFailedError, match="no hot spare became ready within 0s to replace rank 1"):
        c.report_failure(["n0.1"], "killed", detected_at=1.0, me="a", spare_timeout=0.2)


def test_spares_of_a_dead_node_are_not_used(kv):
    c = coordinator(kv)
    c.declare_node_dead(1, "agent0")
    assert c.ready_spares() == ["n0.2"]
    with pytest.raises(JobFailedError, match="replace rank 3"):  # rank 2 took the only live spare
        c.report_failure(["n1.0", "n1.1"], "node 1 lost", detected_at=1.0, me="a", spare_timeout=0.2)
    assert kv.get("spare/n0.2") == b"ready"  # the claim was given back


def test_a_dead_spare_that_was_assigned_is_a_failure_of_its_rank(kv):
    c = coordinator(kv)
    assert c.spare_gone("n0.2") is None  # waiting: just leaves the pool
    plan = c.report_failure(["n1.1"], "killed", detected_at=1.0, me="a")
    assert plan.replaced == {3: "n1.2"}
    assert c.spare_gone("n1.2") == (1, 3)


# A plan writer on node 1 (its own process and store connection): wins epoch 1,
# claims its node's spare, says so, and waits to be killed before it writes the plan.
LOST_WRITER = """
import sys, time
from peerstate.control.kvstore import TorchKeyValueStore
kv = TorchKeyValueStore("127.0.0.1", int(sys.argv[1]), timeout=10)
assert kv.compare_set("epoch/1/owner", b"", b"agent1") == b"agent1"
assert kv.compare_set("spare/n1.2", b"ready", b"assigned:1:2") == b"assigned:1:2"
print("claimed", flush=True)
time.sleep(60)
"""


def test_a_plan_writer_lost_before_its_plan_is_taken_over(kv):
    c = coordinator(kv, spares=("n0.2", "n0.3", "n1.2"))
    writer = subprocess.Popen([sys.executable, "-c", LOST_WRITER, str(kv.port)], stdout=subprocess.PIPE)
    try:
        assert writer.stdout.readline() == b"claimed\n"
    finally:
        writer.kill()
        writer.wait()
    done = []
    waiter = threading.Thread(target=lambda: done.append(Coordinator(kv.clone()).report_failure(
        ["n1.0", "n1.1"], "node 1 lost", detected_at=1.0, me="agent0", spare_timeout=5, writer_grace=10)))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive()  # node 1 is not declared lost yet: its writer may still finish
    assert c.declare_node_dead(1, "agent0")  # what agent 0's lease watch does once node 1's lease expires
    assert not c.declare_node_dead(1, "agent2")  # declared once
    waiter.join(timeout=10)
    plan = done[0]
    assert plan.epoch == 1 and plan.failed == [2, 3]
    assert sorted(plan.replaced.values()) == ["n0.2", "n0.3"]
    assert kv.get("epoch/1/owner") == b"agent0"
    assert kv.get("spare/n1.2") == b"assigned:1:2"  # the lost writer's claim stays out of the pool


def test_a_silent_plan_writer_on_a_live_node_is_a_clear_error(kv):
    c = coordinator(kv)
    kv.compare_set("epoch/1/owner", b"", b"agent1")
    with pytest.raises(JobFailedError, match="agent1 began epoch 1's recovery plan but neither wrote it nor was"):
        c.report_failure(["n1.0"], "killed", detected_at=1.0, me="agent0", spare_timeout=0.2, writer_grace=0.5)
    assert kv.get("epoch/1/owner") == b"agent1" and kv.get("epoch/1/plan") is None


def test_waiting_for_an_owner_looks_for_its_loss_once_per_poll(kv):
    # Every node of a large job waits so while the plan writer computes: the poll sets its store load.
    Coordinator(kv).kv.set("config", b'{"nnodes": 2, "nproc_per_node": 2, "world_size": 4}')
    kv.compare_set("epoch/1/owner", b"", b"agent1")
    waiter = Coordinator(kv.clone())
    before = kv.count.requests
    with pytest.raises(JobFailedError, match="agent1 began epoch 1's restore instructions"):
        waiter.wait_or_take_over(1, "epoch/1/orders/0", "agent0", 2.0, "restore instructions", poll=1.0)
    cycles = kv.count.requests - before  # a wait, the owner (two requests) and its node's flag per poll
    assert 8 <= cycles <= 4 * 3, cycles  # two or three polls in 2 s, not eight


def test_the_agent_learns_which_of_its_spares_the_latest_plan_named(kv):
    c = coordinator(kv)
    plan = RecoveryPlan(1, {**MEMBERS, 2: "n1.2"}, {2: "n1.2"}, [2], "killed", 1.0, 2.0)
    kv.set("epoch/1/plan", plan.encode())  # written; its writer may have died right after
    assert c.assignments(["n0.2", "n1.2"]) == {"n1.2": 2}


def report(rank, local=(), replicas=None, needs_state=False):
    return MemberReport(rank, f"w{rank}", list(local), dict(replicas or {}), ("127.0.0.1", 1), needs_state)


PLACEMENT_4 = dict(node_of_rank=[0, 0, 1, 1], k=1)  # buddies: 0<->2, 1<->3


def test_recovery_point_is_the_newest_version_held_for_every_rank():
    placement = BuddyPlacement(**PLACEMENT_4)
    reports = {0: report(0, [9, 10], {2: [9]}), 1: report(1, [9, 10], {3: [10, 9]}),
               2: report(2, needs_state=True), 3: report(3, [9, 10], {1: [10, 9]})}
    # rank 2's replica on rank 0 is one step behind (its round of 10 had not landed)
    assert recovery_point(reports, placement) == (9, {})
    assert sources_of(2, 9, reports, placement) == [0]


def test_a_lost_node_recovers_to_the_version_both_its_ranks_still_have():
    # node 1 (ranks 2 and 3) dies while rank 2's round of 11 is landing on rank 0 and
    # rank 3's has landed on rank 1: rank 1 still holds rank 3's 10 beside its 11
    placement = BuddyPlacement(**PLACEMENT_4)
    reports = {0: report(0, [10, 11], {2: [10]}), 1: report(1, [10, 11], {3: [11, 10]}),
               2: report(2, needs_state=True), 3: report(3, needs_state=True)}
    assert recovery_point(reports, placement) == (10, {})
    assert sources_of(3, 10, reports, placement) == [1]


def test_recovery_point_names_the_lost_shards():
    placement = BuddyPlacement(**PLACEMENT_4)
    reports = {0: report(0, needs_state=True), 1: report(1, [5], {3: [5]}),
               2: report(2, needs_state=True), 3: report(3, [5], {1: [5]})}
    version, lost = recovery_point(reports, placement)
    assert version is None
    assert lost[0] == "shard of rank 0 has no surviving copy (its holders [2] were lost too)"
    assert set(lost) == {0, 2}


def test_recovery_point_from_a_replica_group_peer():
    placement = BuddyPlacement(node_of_rank=[0, 1, 0, 1], k=1, replica_groups=[[0, 1], [2, 3]])
    reports = {0: report(0, needs_state=True), 1: report(1, [6, 7]), 2: report(2, [6, 7]), 3: report(3, [6, 7])}
    assert recovery_point(reports, placement) == (7, {})
    assert sources_of(0, 7, reports, placement) == [1]


def test_no_common_version_is_reported():
    placement = BuddyPlacement(**PLACEMENT_4)
    reports = {0: report(0, [3, 4], {2: [2]}), 1: report(1, [3, 4]), 2: report(2, needs_state=True),
               3: report(3, [3, 4])}
    assert recovery_point(reports, placement) == (
        None, {-1: "no version is held for every rank at once (the copies are of different steps)"})


def test_timeline_phases_add_up_to_the_recovery():
    plan = {"epoch": 1, "failed": [2], "replaced": {2: "n0.2"}, "reason": "killed", "detected_at": 100.0,
            "planned_at": 100.05}
    marks = [{"abort": 100.2, "re-form": 100.5, "restore": 100.6, "first step": 101.0},
             {"abort": 100.3, "re-form": 100.4, "transfer": 100.9, "restore": 100.95, "first step": 101.1}]
    timeline = recovery_timeline(plan, marks, fault_time=99.9)
    phases = timeline["phases_s"]
    assert phases["detect"] == pytest.approx(0.1)
    assert phases["plan"] == pytest.approx(0.05) and phases["abort"] == pytest.approx(0.25)
    assert phases["re-form"] == pytest.approx(0.2)
    assert phases["transfer"] == pytest.approx(0.4) and phases["restore"] == pytest.approx(0.05)
    assert phases["first step"] == pytest.approx(0.15)
    assert timeline["total_s"] == pytest.approx(sum(phases.values()))


def test_an_event_still_being_appended_is_left_for_the_next_read(tmp_path):
    # Workers append to the log while the launcher's progress line reads it: a
    # reader once met half a line (json.loads failed and took the demo down).
    path = str(tmp_path / "events.jsonl")
    EventLog(path, "n0.0").write("joined", rank=0)
    with open(path, "a") as log:
        log.write('{"time": 1.0, "event": "recov')
    assert [e["event"] for e in read_events(path)] == ["joined"]
    with open(path, "a") as log:
        log.write('ery", "source": "n0.1"}\n')
    assert [e["event"] for e in read_events(path)] == ["joined", "recovery"]


def test_data_parallel_state_comes_from_any_surviving_member():
    placement = BuddyPlacement(**PLACEMENT_4)
    shares = DataParallelShares(node_of_rank=[0, 0, 1, 1], count=1)
    # rank 2's own state (RNG...) is on rank 0 at 9 and 10; the survivors hold 10 and 11
    reports = {0: report(0, [10, 11], {2: [10, 9]}), 1: report(1, [10, 11]), 2: report(2, needs_state=True),
               3: report(3, [10, 11])}
    assert recovery_point(reports, placement, shares) == (10, {})
    assert share_sources(0, 10, reports, shares) == [0, 1, 3]
    # a lost node takes rank 2's own state with it (its buddy, rank 0)
    reports[0] = report(0, needs_state=True)
    version, lost = recovery_point(reports, placement, shares)
    assert version is None and "rank 2" in lost[2] and 0 in lost


def test_data_parallel_shares_are_held_once_per_node():
    shares = DataParallelShares(node_of_rank=[0, 0, 1, 1, 2, 2], count=2)
    assert [shares.share_of(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert shares.holders(1) == [1, 3, 5]
    # equal bytes: items laid end to end and cut in the middle, an item across the cut
    # cut at a multiple of the alignment below it (whole items otherwise)
    assert shares.split([100, 10, 10, 30, 60, 5], alignment=4) == [
        [(0, 0, 100)], [(0, 0, 4), (1, 4, 10)], [(1, 0, 10)], [(1, 0, 30)], [(1, 0, 60)], [(1, 0, 5)]]
    assert shares.split([256 << 20, 100]) == [[(0, 0, 128 << 20), (1, 128 << 20, 256 << 20)], [(1, 0, 100)]]
    thirds = DataParallelShares(node_of_rank=[0, 0, 0, 1, 1, 1], count=3)
    assert thirds.split([5000] * 3, alignment=1000) == [[(0, 0, 5000)], [(1, 0, 5000)], [(2, 0, 5000)]]
    # a cut that aligns down to the item's start moves to the next share: share 0 gets
    # nothing here (the job refuses a share count that leaves a share empty)
    assert thirds.split([10_000], alignment=4096) == [[(1, 0, 4096), (2, 4096, 10_000)]]
    with pytest.raises(InvalidArgumentError, match="ranks of the smallest node"):
        DataParallelShares(node_of_rank=[0, 0, 1], count=2)
    with pytest.raises(InvalidArgumentError, match="one node would keep one copy"):
        DataParallelShares(node_of_rank=[0, 0], count=2)


def test_members_fold_the_replaced_ranks_over_the_initial_layout_without_listing_every_rank():
    members = Members(world_size=6, nproc_per_node=2)
    assert dict(members) == {0: "n0.0", 1: "n0.1", 2: "n1.0", 3: "n1.1", 4: "n2.0", 5: "n2.1"}
    members.update({2: "n0.2", 3: "n2.2"})  # node 1 lost, its ranks on node 0's and node 2's spares
    assert members[2] == "n0.2" and members[4] == "n2.0" and len(members) == 6
    assert members.on_node(1) == [] and members.on_node(0) == ["n0.0", "n0.1", "n0.2"]
    assert members.ranks_of(["n1.0", "n0.2", "n2.1", "n2.2", "n5.0"]) == [2, 3, 5]
    copy = members.copy()
    copy.update({0: "n2.3"})
    assert members[0] == "n0.0" and copy[0] == "n2.3" and copy != members
    with pytest.raises(KeyError):
        members[6]


def test_hsdp_replica_sets_are_the_groups_along_the_replicate_dimension():
    assert mesh_replica_sets(4, (2, 2), 0) == [[0, 2], [1, 3]]  # ("replicate", "shard"): the same shard
    assert mesh_replica_sets(8, (2, 2, 2), 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh_replica_sets(6, (3, 2), 1) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(InvalidArgumentError, match="no dimension 2"):
        mesh_replica_sets(4, (2, 2), 2)
    # one member of each set per node: one share per set, numbered across the job
    sets = mesh_replica_sets(8, (2, 4), 0)
    nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    assert default_share_count(nodes, sets) == 1 and default_share_count(nodes) == 4
    shares = DataParallelShares(nodes, 1, sets)
    assert shares.total == 4 and [shares.share_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert shares.holders(2) == [2, 6] and list(shares.set_shares(6)) == [2]
    # sets of 4 over 2 nodes: 2 members per node, so up to 2 shares per set
    sets = mesh_replica_sets(8, (4, 2), 0)  # [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert default_share_count(nodes, sets) == 2
    shares = DataParallelShares(nodes, 2, sets)
    assert [shares.share_of(r) for r in range(8)] == [0, 2, 1, 3, 0, 2, 1, 3]
    assert [shares.local(s) for s in range(4)] == [0, 1, 0, 1] and list(shares.set_shares(3)) == [2, 3]
    with pytest.raises(InvalidArgumentError, match="between 1 and the members a replica set has on a node"):
        DataParallelShares(nodes, 3, sets)
    with pytest.raises(InvalidArgumentError, match="on one node would keep one copy"):
        DataParallelShares([0, 0, 1, 1], 2, [[0, 1], [2, 3]])
    with pytest.raises(InvalidArgumentError, match="every rank of 0..3 once"):
        DataParallelShares([0, 0, 1, 1], 1, [[0, 1], [1, 3]])


def test_every_member_needs_every_share_at_the_recovery_point():
    placement = BuddyPlacement(**PLACEMENT_4)
    shares = DataParallelShares(node_of_rank=[0, 0, 1, 1], count=2)  # share 0: ranks 0, 2; share 1: ranks 1, 3
    reports = {0: report(0, [10, 11], {2: [10, 11]}), 1: report(1, [10, 11], {3: [11, 10]}),
               2: report(2, needs_state=True), 3: report(3, [10, 11], {1: [10, 11]})}
    assert recovery_point(reports, placement, shares) == (11, {})
    assert share_sources(0, 11, reports, shares) == [0]  # rank 2 needs state: not a source
    assert share_sources(1, 11, reports, shares) == [1, 3]
    # rank 1 is lost too: share 1 is left on rank 3 only, at 9 and 10, though every other copy is at 11
    reports[1] = report(1, needs_state=True)
    reports[3] = report(3, [9, 10], {1: [10, 11]})
    assert recovery_point(reports, placement, shares) == (10, {})
    assert share_sources(1, 10, reports, shares) == [3]
    # both holders of share 0 are lost: it is lost for everyone, whatever the buddies hold
    reports = {0: report(0, needs_state=True), 1: report(1, [10, 11], {0: [11]}),
               2: report(2, needs_state=True), 3: report(3, [10, 11], {2: [11]})}
    version, lost = recovery_point(reports, BuddyPlacement(node_of_rank=[0, 1, 0, 1], k=1), shares=None)
    assert version == 11  # the buddies alone would do
    version, lost = recovery_point(reports, BuddyPlacement(node_of_rank=[0, 1, 0, 1], k=1),
                                   DataParallelShares(node_of_rank=[0, 1, 0, 1], count=1))
    assert version == 11  # and so would full copies
    version, lost = recovery_point(reports, BuddyPlacement(node_of_rank=[0, 1, 0, 1], k=1),
                                   DataParallelShares(node_of_rank=[0, 0, 1, 1], count=2))
    assert version is None and lost == {0: "data-parallel share 0 has no surviving copy (its holders [0, 2] "
                                            "were all lost)"}


def test_a_regroup_keeps_the_members_and_its_timeout_outlives_it(kv):
    c = coordinator(kv)
    first = c.regroup(0, "busy rank", writer="agent0", me="n0.1", collective_timeout=4.0)
    assert (first.epoch, first.failed, first.replaced, first.members) == (1, [], {}, MEMBERS)
    assert first.writer == "agent0" and first.collective_timeout == 4.0
    # The other members that timed out ask too: epoch 1 began already, nothing more is written.
    assert Coordinator(kv.clone()).regroup(0, "busy rank", writer="agent1", me="n1.0", collective_timeout=4.0) is None
    assert kv.get(keys.epoch_plan(2)) is None
    # The claim is not agent0's own: its report of a failure must not take epoch 1 for its claim.
    assert kv.get(keys.epoch_owner(1)) == b"agent0/n0.1"
    later = Coordinator(kv.clone()).report_failure(["n1.0"], "killed", detected_at=2.0, me="agent0")
    assert later.epoch == 2 and later.collective_timeout == 4.0  # a failure keeps the regroup's timeout
    assert RecoveryPlan.decode(later.encode()).collective_timeout == 4.0

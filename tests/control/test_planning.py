"""Restore planning (``plan_restore``): what each member does at a recovery,
from hand-made reports, with no store and no process."""

from peerstate import BuddyPlacement, DataParallelShares
from peerstate.control.messages import MemberReport, RestoreSource, SharePull
from peerstate.control.planning import describe_loss, plan_nodes, plan_restore

NODES = [0, 0, 1, 1]  # buddies: 0<->2, 1<->3
FAILED = [2]


def report(rank, local=(), replicas=None, needs_state=False, pid=0, regions=None):
    return MemberReport(rank, f"n{NODES[rank]}.{rank % 2}", list(local), dict(replicas or {}), ("127.0.0.1", 1000 + rank),
                        needs_state, pid, dict(regions or {}))


def plan(rank, reports, shares=None, checkpoint=None, placement=None):
    placement = placement or BuddyPlacement(NODES, k=1)
    return plan_restore(rank, reports, placement, shares, FAILED, checkpoint)


def test_a_survivor_rolls_back_from_its_own_snapshot():
    reports = {0: report(0, [8, 9], {2: [9]}), 1: report(1, [8, 9], {3: [9]}), 2: report(2, needs_state=True),
               3: report(3, [8, 9], {1: [9]})}
    restore = plan(0, reports)
    assert restore.source is RestoreSource.LOCAL and restore.version == 9
    assert restore.own_sources == [] and restore.shares == {}


def test_a_replacement_pulls_its_state_from_its_buddy():
    reports = {0: report(0, [8, 9], {2: [8, 9]}), 1: report(1, [8, 9], {3: [9]}), 2: report(2, needs_state=True),
               3: report(3, [8, 9], {1: [9]})}
    restore = plan(2, reports)
    assert restore.source is RestoreSource.PEERS and restore.version == 9
    assert restore.own_sources == [0]


def test_with_shares_a_survivor_pulls_the_shares_it_does_not_snapshot():
    shares = DataParallelShares(NODES, 2)  # share 0: ranks 0 and 2; share 1: ranks 1 and 3
    reports = {0: report(0, [5], {2: [5]}, pid=10, regions={5: 0x1000}), 1: report(1, [5], {3: [5]}, pid=11,
                                                                                   regions={5: 0x2000}),
               2: report(2, needs_state=True), 3: report(3, [5], {1: [5]}, pid=13, regions={5: 0x3000})}
    restore = plan(0, reports, shares)
    assert restore.source is RestoreSource.LOCAL and restore.version == 5
    # share 0 is its own; share 1 comes from rank 1 (same node: read from its memory) and rank 3
    assert restore.shares == {1: SharePull(1, [1, 3], {1: (11, 0x2000)})}


def test_with_shares_a_replacement_pulls_every_share_from_the_members_that_kept_theirs():
    shares = DataParallelShares(NODES, 2)
    reports = {0: report(0, [5], {2: [5]}, pid=10, regions={5: 0x1000}), 1: report(1, [5], {3: [5]}),
               2: report(2, needs_state=True), 3: report(3, [5], {1: [5]}, pid=13, regions={5: 0x3000})}
    restore = plan(2, reports, shares)
    assert restore.source is RestoreSource.PEERS and restore.own_sources == [0]
    assert restore.shares == {0: SharePull(0, [0], {}), 1: SharePull(1, [1, 3], {3: (13, 0x3000)})}


def test_a_lost_state_falls_back_to_the_newest_checkpoint():
    reports = {0: report(0, needs_state=True), 1: report(1, [5], {3: [5]}), 2: report(2, needs_state=True),
               3: report(3, [5], {1: [5]})}
    restore = plan(1, reports, checkpoint=(4, "/ckpt/step_000000004"))
    assert restore.source is RestoreSource.CHECKPOINT
    assert (restore.version, restore.checkpoint) == (4, "/ckpt/step_000000004")
    assert restore.message.startswith("ranks 0 and 2 lost; shard of rank 0 has no surviving copy")


def test_a_lost_state_without_a_checkpoint_is_lost_and_says_why():
    shares = DataParallelShares(NODES, 2)
    reports = {0: report(0, needs_state=True), 1: report(1, [5], {3: [5]}), 2: report(2, needs_state=True),
               3: report(3, [5], {1: [5]})}
    restore = plan(1, reports, shares)
    assert restore.source is RestoreSource.LOST and restore.version is None
    assert "data-parallel share 0 has no surviving copy (its holders [0, 2] were all lost)" in restore.message


def test_the_loss_message_names_the_failed_ranks_when_only_versions_disagree():
    assert describe_loss({-1: "no version is held for every rank at once"}, [3]) == (
        "rank 3 lost; no version is held for every rank at once")


HSDP_SETS = [[0, 2], [1, 3]]  # ("replicate", "shard") = 2 x 2: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1


def test_under_hsdp_a_replacement_pulls_its_shard_from_its_replica_and_only_its_own_state_from_its_buddy():
    shares = DataParallelShares(NODES, 1, HSDP_SETS)  # set 0's share is 0, set 1's is 1
    reports = {0: report(0, [5], {2: [5]}, pid=10, regions={5: 0x1000}), 1: report(1, [5], {3: [5]}, pid=11,
                                                                                   regions={5: 0x2000}),
               2: report(2, [5], {0: [5]}, pid=12, regions={5: 0x3000}), 3: report(3, needs_state=True)}
    restore = plan(3, reports, shares)
    assert restore.source is RestoreSource.PEERS and restore.own_sources == [1]
    # its set's one share, by its index in the set (0), from rank 1: not rank 0's or rank 2's shard
    assert restore.shares == {0: SharePull(0, [1], {})}
    # the survivors hold their whole shard: nothing to pull
    assert all(plan(r, reports, shares).shares == {} for r in (0, 1, 2))


def test_under_hsdp_a_node_reads_only_its_members_sets_and_a_lost_set_is_named():
    shares = DataParallelShares([0, 1, 2, 3], 1, [[0, 1], [2, 3]])  # one rank per node
    placement = BuddyPlacement([0, 1, 2, 3], k=1)
    reports = {r: MemberReport(r, f"n{r}.0", [5], {(r - 1) % 4: [5]}, ("127.0.0.1", 1000 + r)) for r in range(4)}
    reports[0] = MemberReport(0, "n0.0", [], {}, ("127.0.0.1", 1000), needs_state=True)
    orders = plan_nodes(1, reports, placement, shares, [0])
    assert orders[0].share_sources == {0: [1]} and orders[2].share_sources == {1: [2, 3]}  # not set 1 on node 0
    assert orders[0].share_count == 1 and orders[0].share_of == {0: 0}
    reports[1] = MemberReport(1, "n1.0", [], {}, ("127.0.0.1", 1001), needs_state=True)
    restore = plan_restore(2, reports, placement, shares, [0, 1])
    assert restore.source is RestoreSource.LOST
    assert "data-parallel share 0 has no surviving copy (its holders [0, 1] were all lost)" in restore.message

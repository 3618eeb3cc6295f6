"""Restore planning with parity groups (``Job(parity_group=g)``), from hand-made reports:
the recovery point is a version the lost rank's whole group covers, the survivors of the
group rebuild their pieces, the replacement pulls from the group, and two losses in one
group are a loss that names it."""

import warnings

import pytest

from peerstate.control.messages import MemberReport, RestoreSource
from peerstate.control.planning import plan_restore, recovery_point
from peerstate.errors import InvalidArgumentError
from peerstate.replication.parity import ParityPlacement

NODES = [0, 1, 2, 3, 0, 1, 2, 3]  # two groups of 4: ranks 0-3 (local index 0) and 4-7 (local index 1)


def placement():
    return ParityPlacement(NODES, 4)


def report(rank, local=(), parity=(), needs_state=False):
    return MemberReport(rank, f"n{NODES[rank]}.{rank // 4}", list(local), {}, ("127.0.0.1", 1000 + rank),
                        needs_state, parity=list(parity))


def survivors():
    """Every rank holding versions 8 and 9 of its own state and of its group's parity."""
    return {r: report(r, [8, 9], [8, 9]) for r in range(8)}


def test_groups_are_ranks_of_one_local_index_on_four_nodes():
    assert placement().group_of(2) == [0, 1, 2, 3] and placement().group_of(5) == [4, 5, 6, 7]
    assert placement().served_by(2) == [] and placement().holders(2) == [0, 1, 3]


def test_the_replacement_pulls_from_its_group_and_the_group_rebuilds_its_pieces():
    reports = survivors()
    reports[2] = report(2, needs_state=True)
    restore = plan_restore(2, reports, placement(), None, [2])
    assert restore.source is RestoreSource.PEERS and restore.version == 9
    assert restore.parity and restore.own_sources == [0, 1, 2, 3]
    for holder in (0, 1, 3):
        local = plan_restore(holder, reports, placement(), None, [2])
        assert local.source is RestoreSource.LOCAL and local.version == 9 and local.rebuild == [2]
    other_group = plan_restore(5, reports, placement(), None, [2])
    assert other_group.source is RestoreSource.LOCAL and other_group.rebuild == []


def test_the_point_is_a_version_every_other_member_covers_whole():
    reports = survivors()
    reports[2] = report(2, needs_state=True)
    reports[1] = report(1, [8, 9, 10], [8])  # its block of 9 was not complete when the failure came
    assert recovery_point(reports, placement())[0] == 8
    reports[3] = report(3, [9, 10], [8, 9])  # and it no longer holds its own snapshot of 8
    version, lost = recovery_point(reports, placement())
    assert version is None and "no version its parity group [0, 1, 2, 3] covers whole" in lost[2], lost


def test_two_losses_in_one_group_are_a_loss_that_names_the_group():
    reports = survivors()
    reports[1] = report(1, needs_state=True)
    reports[2] = report(2, needs_state=True)
    version, lost = recovery_point(reports, placement())
    assert version is None
    assert lost[1] == lost[2] == ("parity group [0, 1, 2, 3] lost ranks 1, 2: a group rebuilds one lost member, so "
                                  "their state has no surviving copy")
    restore = plan_restore(0, reports, placement(), None, [1, 2], checkpoint=(5, "/ckpt"))
    assert restore.source is RestoreSource.CHECKPOINT and restore.version == 5
    assert restore.message.count("parity group [0, 1, 2, 3]") == 1, restore.message  # said once, not per rank


def test_one_loss_in_each_of_two_groups_is_two_rebuilds():
    reports = survivors()
    reports[1] = report(1, needs_state=True)
    reports[6] = report(6, needs_state=True)
    assert recovery_point(reports, placement()) == (9, {})
    assert plan_restore(0, reports, placement(), None, [1, 6]).rebuild == [1]
    assert plan_restore(7, reports, placement(), None, [1, 6]).rebuild == [6]


def test_a_group_of_two_is_refused_as_a_mirror():
    with warnings.catch_warnings(), pytest.raises(InvalidArgumentError, match="a group of 2 is a mirror"):
        warnings.simplefilter("ignore")
        ParityPlacement([0, 0, 1, 1], 4)  # two nodes: groups of 2

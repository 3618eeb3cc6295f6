import warnings

import pytest

import peerstate
from peerstate import BuddyPlacement, PlacementWarning


def test_two_nodes_k1_crosses_nodes_and_balances():
    p = BuddyPlacement(["a", "a", "b", "b"], k=1)
    assert [p.holders(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert all(len(p.served_by(h)) == 1 for h in range(4))
    assert p.warnings == []


def test_k2_over_three_nodes_spreads_copies_over_distinct_nodes():
    nodes = ["a", "a", "b", "b", "c", "c"]
    p = BuddyPlacement(nodes, k=2)
    for r in range(6):
        hs = p.holders(r)
        assert len(hs) == 2 and len({nodes[h] for h in hs} | {nodes[r]}) == 3
    assert sorted(len(p.served_by(h)) for h in range(6)) == [2] * 6  # equal bytes per holder


def test_placement_is_deterministic():
    nodes = [f"n{i // 8}" for i in range(64)]
    assert [BuddyPlacement(nodes, k=2).holders(r) for r in range(64)] == [
        BuddyPlacement(list(nodes), k=2).holders(r) for r in range(64)]


@pytest.mark.parametrize("k", [1, 2])
def test_racks_are_separated_when_possible(k):
    nodes = ["n0", "n1", "n2", "n3"]
    racks = ["r0", "r0", "r1", "r1"]  # one rank per node
    p = BuddyPlacement(nodes, k=k, rack_of_rank=racks)
    for r in range(4):
        assert all(racks[h] != racks[r] for h in p.holders(r)) and len(set(p.holders(r))) == k
    assert sorted(len(p.served_by(h)) for h in range(4)) == [k] * 4
    assert p.warnings == []


def test_one_node_warns_loudly_or_refuses():
    with pytest.warns(PlacementWarning, match="all 4 ranks are on one node"):
        p = BuddyPlacement(["solo"] * 4, k=1)
    assert all(p.holders(r) and p.holders(r)[0] != r for r in range(4))
    with pytest.raises(peerstate.InvalidArgumentError, match="cannot separate failure domains"):
        BuddyPlacement(["solo"] * 4, k=1, strict=True)


def test_more_copies_than_other_nodes_warns():
    with pytest.warns(PlacementWarning, match="k=2 copies need 2 other nodes but there are only 1"):
        p = BuddyPlacement(["a", "a", "b", "b"], k=2)
    assert all(len(set(p.holders(r))) == 2 and r not in p.holders(r) for r in range(4))


def test_replica_groups_need_no_buddies():
    p = BuddyPlacement(["a", "a", "b", "b"], k=1, replica_groups=[[0, 2], [1, 3]])
    assert p.holders(0) == [] and p.sources(0) == [2] and p.sources(3) == [1]
    assert p.served_by(0) == []
    with pytest.warns(PlacementWarning, match="lies on one node"):
        BuddyPlacement(["a", "a", "b", "b"], k=1, replica_groups=[[0, 1]])


def test_lost_names_ranks_without_a_surviving_copy():
    p = BuddyPlacement(["a", "a", "b", "b"], k=1)
    assert p.lost([0]) == []
    assert p.lost([0, 2]) == [0, 2]  # each is the other's only buddy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p2 = BuddyPlacement(["a", "a", "b", "b"], k=2)
    assert p2.lost([0, 2]) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(node_of_rank=[], k=1), "empty"),
    (dict(node_of_rank=["a", "b"], k=2), "k must be between 1 and"),
    (dict(node_of_rank=["a", "b"], k=1, rack_of_rank=["r"]), "rack_of_rank has 1 entries"),
    (dict(node_of_rank=["a", "b"], k=1, replica_groups=[[0, 5]]), "outside"),
    (dict(node_of_rank=["a", "b", "c"], k=1, replica_groups=[[0, 1], [1, 2]]), "two replica groups"),
])
def test_bad_layouts(kwargs, message):
    with pytest.raises(peerstate.InvalidArgumentError, match=message):
        BuddyPlacement(**kwargs)


def test_replica_budget_checked_at_setup():
    from peerstate import _C

    replicas = _C.ReplicaStore(budget_bytes=10 << 20)
    replicas.reserve(0, 4 << 20)
    with pytest.raises(peerstate.BudgetExceededError, match="over its budget of 10485760 bytes"):
        replicas.reserve(1, 2 << 20)  # 2 x 4 + 2 x 2 MiB > 10 MiB
    assert replicas.reserved_bytes() == 8 << 20


def test_bytes_of_rank_balances_bytes_per_holder():
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    sizes = [8, 8, 1, 1, 1, 1, 1, 1]  # two big pipeline stages on node a

    def max_load(p):
        return max(sum(sizes[r] for r in p.served_by(h)) for h in range(8))

    ring = BuddyPlacement(nodes, k=1)
    balanced = BuddyPlacement(nodes, k=1, bytes_of_rank=sizes)
    assert max_load(ring) == 8 and max_load(balanced) == 8  # a big rank's copy weighs 8 wherever it goes
    assert sorted(sum(sizes[r] for r in balanced.served_by(h)) for h in range(8))[-2:] == [8, 8]
    # ...but the two big copies never land on one holder, and every copy leaves its node.
    for r in range(8):
        assert len(balanced.holders(r)) == 1 and nodes[balanced.holders(r)[0]] != nodes[r]
    holders_of_big = {balanced.holders(0)[0], balanced.holders(1)[0]}
    assert len(holders_of_big) == 2
    assert balanced.holders(0) == BuddyPlacement(nodes, k=1, bytes_of_rank=sizes).holders(0)  # deterministic


def test_bytes_of_rank_k2_spreads_over_nodes_and_racks():
    nodes = ["n0", "n1", "n2", "n3"] * 2
    racks = ["r0", "r0", "r1", "r1"] * 2
    sizes = [5, 3, 3, 2, 2, 1, 1, 1]
    p = BuddyPlacement(nodes, k=2, rack_of_rank=racks, bytes_of_rank=sizes)
    for r in range(8):
        hs = p.holders(r)
        assert len(set(hs)) == 2 and r not in hs
        assert all(nodes[h] != nodes[r] and racks[h] != racks[r] for h in hs)
    loads = [sum(sizes[r] for r in p.served_by(h)) for h in range(8)]
    assert max(loads) - min(loads) <= max(sizes)
    assert p.warnings == []

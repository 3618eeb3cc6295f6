"""Parity groups: who forms a group, where each piece goes, and the native XOR codec
rebuilding any one lost member bitwise (peerstate.replication.parity)."""

import itertools
import warnings

import numpy as np
import pytest

from peerstate._C import ParityCoder, parity_pieces
from peerstate.errors import InvalidArgumentError
from peerstate.replication.parity import ParityGroups, ParityLayout, encode, rebuild, rebuild_piece
from peerstate.replication.placement import PlacementWarning


CHUNK = 64  # bytes: small chunks, so that small shards cut into several pieces as large ones do


def shards_of(sizes, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def all_parities(coder, layout, shards):
    return [encode(coder, layout, holder, shards) for holder in range(layout.members)]


def test_the_native_fold_is_xor_with_short_sources_as_zeros():
    coder = ParityCoder(2)
    rng = np.random.default_rng(1)
    sizes = [300_001, 200_000, 0, 300_001, 65_537]
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    expected = np.zeros(300_001, np.uint8)
    for source in sources:
        expected[:source.nbytes] ^= source
    out = np.empty(300_001, np.uint8)
    coder.xor_blocks((out.ctypes.data, out.nbytes), [(s.ctypes.data, s.nbytes) for s in sources])
    assert np.array_equal(out, expected)
    coder.xor_blocks((out.ctypes.data, out.nbytes), [(sources[0].ctypes.data, sources[0].nbytes)], accumulate=True)
    expected ^= sources[0]
    assert np.array_equal(out, expected)
    coder.xor_blocks((out.ctypes.data, out.nbytes), [])
    assert not out.any()


def test_the_native_fold_refuses_what_it_cannot_do_and_writes_nothing():
    coder = ParityCoder(1)
    out = np.full(1000, 7, np.uint8)
    longer = np.zeros(1001, np.uint8)
    with pytest.raises(InvalidArgumentError, match="source 0 has 1001 bytes, more than the destination's 1000"):
        coder.xor_blocks((out.ctypes.data, out.nbytes), [(longer.ctypes.data, longer.nbytes)])
    with pytest.raises(InvalidArgumentError, match="overlaps the destination"):
        coder.xor_blocks((out.ctypes.data, 500), [(out.ctypes.data + 100, 400)])
    with pytest.raises(InvalidArgumentError, match="source 1 is null"):
        coder.xor_blocks((out.ctypes.data, out.nbytes), [(longer.ctypes.data, 10), (0, 10)])
    assert (out == 7).all()
    with pytest.raises(InvalidArgumentError, match="threads must be at least 1"):
        ParityCoder(0).xor_blocks((out.ctypes.data, out.nbytes), [])


@pytest.mark.parametrize("sizes", [[4096] * 4, [1_000_003, 999_937, 12, 0], [5, 4, 3], [777] * 8, [64, 65]])
def test_any_one_lost_member_is_rebuilt_bitwise(sizes):
    coder = ParityCoder(2)
    layout = ParityLayout(sizes, CHUNK)
    shards = shards_of(sizes, seed=len(sizes))
    parities = all_parities(coder, layout, shards)
    for lost in range(len(sizes)):
        survivors = [None if m == lost else s for m, s in enumerate(shards)]
        held = [None if m == lost else p for m, p in enumerate(parities)]
        assert np.array_equal(rebuild(coder, layout, lost, survivors, held), shards[lost])
        # And its own parity block, recomputed from the rebuilt shard, is what it held.
        restored = survivors[:lost] + [shards[lost]] + survivors[lost + 1:]
        assert np.array_equal(encode(coder, layout, lost, restored), parities[lost])


def test_no_member_holds_parity_of_its_own_bytes_and_every_byte_is_covered_once():
    layout = ParityLayout([1000, 640, 999, 1], CHUNK)
    for holder in range(layout.members):
        assert holder not in [m for m, _ in layout.folded_into(holder)]
    for member in range(layout.members):
        covered = sum(layout.piece(member, p)[1] for p in range(layout.members - 1))
        assert covered == layout.sizes[member] == layout.pushed_bytes(member)
        assert sorted(layout.holder(member, p) for p in range(layout.members - 1)) == \
            [m for m in range(layout.members) if m != member]
    # Held per member: a parity block of the largest piece, whole chunks of 64 bytes
    # (1000 bytes are 16 chunks, cut into pieces of 6, 5 and 5 chunks).
    assert layout.held_bytes() == 384


def test_a_parity_is_the_pieces_other_members_folded_into_it():
    coder = ParityCoder(1)
    layout = ParityLayout([300, 300, 300, 300], CHUNK)
    shards = shards_of(layout.sizes, seed=3)
    for holder in range(4):
        expected = np.zeros(layout.piece_bytes, np.uint8)
        for member in range(4):
            if member != holder:
                start, nbytes = layout.piece(member, (holder - member - 1) % 4)
                expected[:nbytes] ^= shards[member][start:start + nbytes]
        assert np.array_equal(encode(coder, layout, holder, shards), expected)


def test_a_changed_survivor_does_not_rebuild_the_lost_member():
    """The survivors' shards must be of the parity's version: one byte of another
    version in a survivor changes the rebuilt shard (the version rule the recovery keeps)."""
    coder = ParityCoder(1)
    layout = ParityLayout([4096] * 4, CHUNK)
    shards = shards_of(layout.sizes, seed=4)
    parities = all_parities(coder, layout, shards)
    newer = [s.copy() for s in shards]
    newer[2][layout.piece(2, (layout.holder(0, 0) - 2 - 1) % 4)[0]] ^= 1
    rebuilt = rebuild(coder, layout, 0, [None] + newer[1:], [None] + parities[1:])
    assert not np.array_equal(rebuilt, shards[0])


def test_rebuild_pieces_run_at_each_holder_on_their_own():
    coder = ParityCoder(1)
    layout = ParityLayout([10_000] * 5, CHUNK)
    shards = shards_of(layout.sizes, seed=5)
    parities = all_parities(coder, layout, shards)
    lost = 3
    for piece in range(4):
        holder = layout.holder(lost, piece)
        offset, nbytes = layout.piece(lost, piece)
        out = np.empty(nbytes, np.uint8)
        # The holder needs neither the lost shard nor its own.
        rebuild_piece(coder, layout, lost, holder, [None if m in (lost, holder) else s for m, s in enumerate(shards)],
                      parities[holder], out)
        assert np.array_equal(out, shards[lost][offset:offset + nbytes])


def test_groups_keep_their_members_on_different_nodes_and_survive_any_node():
    nodes = [n for n in range(8) for _ in range(4)]  # 8 nodes x 4 ranks
    groups = ParityGroups(nodes, group_size=4)
    assert sorted(itertools.chain.from_iterable(groups.groups)) == list(range(32))
    assert [len(g) for g in groups.groups] == [4] * 8
    for group in groups.groups:
        assert len({nodes[r] for r in group}) == len(group)
    for node in range(8):
        dead = [r for r in range(32) if nodes[r] == node]
        assert groups.unrecoverable(dead) == [] and groups.describe_loss(dead) is None
    assert groups.holders(0) == [r for r in groups.group_of(0) if r != 0]


def test_two_losses_in_one_group_are_named():
    nodes = [n for n in range(4) for _ in range(2)]
    groups = ParityGroups(nodes, group_size=4)
    first = groups.groups[0]
    assert groups.unrecoverable([first[0], first[2]]) == [first]
    message = groups.describe_loss([first[0], first[2]])
    assert f"group of ranks {first} lost ranks {min(first[0], first[2])}, {max(first[0], first[2])}" in message
    assert "disk checkpoint" in message


def test_groups_spread_over_racks_first():
    nodes = list(range(8))
    racks = [0, 0, 0, 0, 1, 1, 1, 1]
    groups = ParityGroups(nodes, group_size=2, rack_of_rank=racks)
    assert all(len({racks[r] for r in g}) == 2 for g in groups.groups)


def test_uneven_nodes_still_separate_members():
    nodes = [0, 0, 0, 1, 1, 2, 2, 3, 3]  # node 0 has a third rank no other node matches
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = ParityGroups(nodes, group_size=4)
    for group in groups.groups:
        assert len({nodes[r] for r in group}) == len(group)
    assert sorted(itertools.chain.from_iterable(groups.groups)) == list(range(9))


def test_too_few_nodes_is_said_or_refused():
    with pytest.warns(PlacementWarning, match="one node"):
        ParityGroups([0, 0, 0], group_size=4)
    with pytest.raises(InvalidArgumentError, match="cannot separate failure domains"):
        ParityGroups([0, 0, 0], group_size=4, strict=True)
    with pytest.warns(PlacementWarning, match="some groups have 2 members, not 4: each of them holds a whole copy"):
        groups = ParityGroups([0, 1, 0, 1], group_size=4)
    assert groups.groups == [[0, 1], [2, 3]]
    with pytest.raises(InvalidArgumentError, match="group_size must be at least 2"):
        ParityGroups([0, 1], group_size=1)


def test_bad_buffers_are_refused_with_what_to_do():
    coder = ParityCoder(1)
    layout = ParityLayout([100, 100, 100], CHUNK)
    shards = shards_of(layout.sizes, seed=6)
    with pytest.raises(InvalidArgumentError, match="uint8"):
        encode(coder, layout, 0, [None, shards[1].view(np.int16), shards[2]])
    with pytest.raises(InvalidArgumentError, match="same version"):
        encode(coder, layout, 0, [None, shards[1][:50], shards[2]])
    with pytest.raises(InvalidArgumentError, match="member 1's parity is needed"):
        rebuild(coder, layout, 0, [None, shards[1], shards[2]], [None, None, np.zeros(64, np.uint8)])


def test_any_layout_gets_every_rank_one_group_apart_from_its_node_or_a_warning():
    rng = np.random.default_rng(7)
    for _ in range(300):
        per_node = rng.integers(1, 5, rng.integers(2, 13))
        nodes = [n for n, count in enumerate(per_node) for _ in range(count)]
        size = int(rng.choice([2, 3, 4, 8]))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            groups = ParityGroups(nodes, group_size=size)
        assert sorted(itertools.chain.from_iterable(groups.groups)) == list(range(len(nodes)))
        assert all(2 <= len(g) for g in groups.groups)
        shared = [g for g in groups.groups if len({nodes[r] for r in g}) < len(g)]
        assert bool(shared) == any("no group without a member on its node" in str(w.message) for w in said), \
            (nodes, size, groups.groups)


def test_a_node_with_most_of_the_ranks_is_said():
    with pytest.warns(PlacementWarning, match="no group without a member on its node"):
        ParityGroups([0, 0, 0, 0, 1], group_size=4)


def test_the_redundancy_benchmark_runs_and_checks_its_rebuilds(tmp_path):
    """bench/redundancy.py at a small size: its rows, and each rebuild checked bitwise
    (the benchmark exits non-zero if one differs)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "redundancy.py"
    out = tmp_path / "redundancy.json"
    done = subprocess.run([sys.executable, str(bench), "--sizes", "1", "--repeats", "1", "--out", str(out),
                           "--chunk-bytes", "65536"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["buddies k=1"]["memory_x"] == 6.0 and rows["buddies k=1"]["pushed_x"] == 1.0
    assert rows["parity g=4 m=1"]["rebuilt_bitwise"] and rows["parity g=8 m=1"]["pull_sources"] == 7
    assert rows["parity g=4 m=1"]["held_for_others_x"] < rows["buddies k=1"]["held_for_others_x"] / 2


@pytest.mark.parametrize("nbytes, group", [(4096, 4), (1_000_000, 4), (1_000_000, 8), (200, 4)])
def test_the_layout_cuts_a_shard_as_the_job_does(nbytes, group):
    """The pieces of this layout are those the job pushes (_C.parity_pieces, from the
    snapshot's own layout), for a shard of one buffer."""
    from peerstate.state.snapshot import SnapshotStore
    import torch

    store = SnapshotStore(chunk_bytes=4096, threads=1)
    store.register_many({"shard": torch.zeros(nbytes, dtype=torch.uint8)})
    native = parity_pieces(store.native, None, group)
    layout = ParityLayout([nbytes] * group, 4096)
    # (An empty piece has no offset: the native layout says 0, this one the shard's end.)
    assert [(offset, min(size, nbytes - offset)) if size else 0 for _first, _end, offset, size in native] == \
        [layout.piece(0, t) if layout.piece(0, t)[1] else 0 for t in range(group - 1)]
    store.close()

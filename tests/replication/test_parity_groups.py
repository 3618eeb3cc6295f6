"""Parity groups between real processes on 127.0.0.1: members push pieces, holders
fold them into parity, a member killed with SIGKILL is rebuilt bitwise from its
group's parity and the survivors' own snapshots, and what one loss per group
cannot cover says so. (The job does not run parity groups yet: these drive the
data plane through ``Replication`` as a worker would.)"""

import hashlib

import numpy as np
import pytest

import peerstate
from helpers.cluster import Cluster, wait_until
from helpers.peer import fill, make_tensors

pytestmark = pytest.mark.e2e  # several real processes per test: left out of `-m "not e2e"`

GROUP = [0, 1, 2, 3]  # one rank per node: any node lost costs the group one member
SETUP = dict(large_bytes=3 << 20, small_count=300, small_bytes=1024, chunk_bytes=256 << 10)


def expected_block(holder, version, block_bytes):
    """The parity ``holder`` must keep of ``version``: the XOR of the piece each other
    member sends it, computed here with numpy from the members' states made afresh."""
    block = np.zeros(block_bytes, dtype=np.uint8)
    g = len(GROUP)
    for member in GROUP:
        if member == holder:
            continue
        tensors = make_tensors(SETUP["large_bytes"], SETUP["small_count"], SETUP["small_bytes"])
        fill(tensors, member, version)
        store = peerstate.SnapshotStore(chunk_bytes=SETUP["chunk_bytes"], threads=1)
        store.register_many(tensors)
        store.snapshot(version).wait()
        region = np.frombuffer(store.native.stored_bytes(version), dtype=np.uint8)
        piece = (holder - member - 1) % g  # piece t of member i goes to member (i + 1 + t) mod g
        _first, _end, offset, nbytes = peerstate._C.parity_pieces(store.native, version, g)[piece]
        block[:nbytes] ^= region[offset:offset + nbytes]
        store.close()
    return hashlib.sha256(block.tobytes()).hexdigest()


def ask(peer, cmd, **args):
    """A request whose failure the test expects: the reply, ok or not."""
    peer.send(cmd, **args)
    return peer.reply(timeout=60)


def start_group(cluster, versions):
    """Every member snapshots and pushes ``versions`` (1..), waiting for each round."""
    peers = cluster.peers
    digests = {r: peers[r].call("step", version=1, replicate=False)["digest"] for r in GROUP}
    block_bytes = max(peers[r].call("largest_piece", version=1, group_size=len(GROUP))["nbytes"] for r in GROUP)
    for r in GROUP:
        held = peers[r].call("hold_parity", members=GROUP, block_bytes=block_bytes)["held_bytes"]
        assert held >= 2 * block_bytes
    history = {1: digests}
    for version in range(1, versions + 1):
        if version > 1:
            history[version] = {r: peers[r].call("step", version=version, replicate=False)["digest"] for r in GROUP}
        for r in GROUP:
            peers[r].call("push_pieces", version=version)
        for r in GROUP:
            results = peers[r].call("wait", version=version)["results"]
            assert results == {str(h): None for h in GROUP}, (r, results)  # its own block too
    return block_bytes, history


def test_pieces_fold_into_parity_and_a_killed_member_is_rebuilt_bitwise():
    with Cluster(["a", "b", "c", "d"], k=1, **SETUP) as cluster:
        block_bytes, history = start_group(cluster, versions=3)
        for holder in GROUP:
            parity = cluster.peers[holder].call("parity")
            assert parity["committed"] == [3, 2] and parity["version"] == 3
            assert parity["digest"] == expected_block(holder, 3, block_bytes), holder
        # A third of a state held per member, against a whole one per copy for a buddy.
        assert block_bytes * 3 < cluster.sizes[0] + 3 * SETUP["chunk_bytes"]

        cluster.peers[2].kill()
        replacement = cluster.start(2, name="replacement")
        replacement.call("connect", addresses=cluster.addresses)
        replacement.call("hold_parity", members=GROUP, block_bytes=block_bytes)
        # Until every holder has rebuilt its piece, a pull takes nothing and says so (NotFound: ask again).
        holders = [h for h in GROUP if h != 2]
        assert cluster.peers[holders[0]].call("rebuild_piece", lost=2, version=3)["held_bytes"] >= 3 * block_bytes
        early = ask(replacement, "pull_pieces", rank=2, version=3)
        assert early["error"] == "NotFoundError" and "has rebuilt its piece" in early["message"], early
        for holder in holders[1:]:
            cluster.peers[holder].send("rebuild_piece", lost=2, version=3)
        for holder in holders[1:]:  # at once, each pulling from the two other survivors
            assert cluster.peers[holder].reply(timeout=60)["held_bytes"] >= 3 * block_bytes
        got = replacement.call("pull_pieces", rank=2, version=3)
        assert got == {"ok": True, "version": 3, "digest": history[3][2]}


def test_a_member_killed_mid_round_leaves_the_parity_before_it_whole_and_holds_the_next_back():
    # io_timeout: how long a round waits for a version to be covered before it fails.
    with Cluster(["a", "b", "c", "d"], k=1, io_timeout=3.0, **SETUP) as cluster:
        _, history = start_group(cluster, versions=1)
        peers = cluster.peers
        for r in GROUP:
            peers[r].call("step", version=2, replicate=False)
        for r in (0, 2, 3):
            peers[r].call("push_pieces", version=2)
        peers[1].kill()  # before it pushed version 2: no block of 2 is complete anywhere
        for r in (0, 2, 3):  # a round ends only when its version is covered: these never are
            results = peers[r].call("wait", version=2)["results"]
            # Rank 1's own block needs no piece of its own: it may have been covered before it died.
            assert set(results) == {str(h) for h in GROUP}, results
            assert all(e for h, e in results.items() if h != "1"), results  # the server's or the client's wait ran out
            assert "lacks the pieces of rank 1" in results[str(r)], results
        for holder in (0, 2, 3):
            assert peers[holder].call("parity")["committed"] == [1]
        # Every survivor still holds its own version 1: rank 1's is rebuilt from it.
        for holder in (0, 2, 3):
            peers[holder].send("rebuild_piece", lost=1, version=1)
        for holder in (0, 2, 3):
            reply = peers[holder].reply(timeout=60)
            assert reply["ok"], reply
        replacement = cluster.start(1, name="replacement")
        replacement.call("connect", addresses=cluster.addresses)
        replacement.call("hold_parity", members=GROUP, block_bytes=1)
        got = replacement.call("pull_pieces", rank=1, version=1)
        assert got == {"ok": True, "version": 1, "digest": history[1][1]}

        # A member that goes on to version 3 finds version 2 still lacking rank 1's pieces.
        peers[0].call("step", version=3, replicate=False)
        peers[0].call("push_pieces", version=3)
        results = peers[0].call("wait", version=3)["results"]
        refused = [e for h, e in results.items() if h not in ("0", "1")]  # not itself, nor the dead
        assert refused and all(e and "BusyError" in e and "rank 1" in e for e in refused), results


def test_a_member_that_joins_its_group_late_gets_the_pieces_pushed_before():
    # As at a job's first step, or a replacement's: the others push before it holds its blocks.
    with Cluster(["a", "b", "c", "d"], k=1, **SETUP) as cluster:
        peers = cluster.peers
        for r in GROUP:
            peers[r].call("step", version=1, replicate=False)
        block_bytes = max(peers[r].call("largest_piece", version=1, group_size=4)["nbytes"] for r in GROUP)
        for r in (1, 2, 3):
            peers[r].call("hold_parity", members=GROUP, block_bytes=block_bytes)
            peers[r].call("push_pieces", version=1)  # rank 0 refuses their pieces: it holds no group yet
        peers[0].call("hold_parity", members=GROUP, block_bytes=block_bytes)
        peers[0].call("push_pieces", version=1)
        for r in GROUP:
            results = peers[r].call("wait", version=1)["results"]
            assert results == {str(h): None for h in GROUP}, (r, results)
        assert peers[0].call("parity")["digest"] == expected_block(0, 1, block_bytes)


def test_two_losses_in_one_group_cannot_be_rebuilt_and_say_who_is_missing():
    with Cluster(["a", "b", "c", "d"], k=1, **SETUP) as cluster:
        start_group(cluster, versions=1)
        cluster.peers[1].kill()
        cluster.peers[2].kill()
        assert wait_until(lambda: not cluster.peers[2].alive(), 10)
        reply = ask(cluster.peers[0], "rebuild_piece", lost=1, version=1)
        assert not reply["ok"] and reply["error"] == "PeerConnectionError", reply
        assert "rank 2" in reply["message"], reply
        # Nothing was rebuilt, so nothing can be pulled: the replacement is told so.
        replacement = cluster.start(1, name="replacement")
        replacement.call("connect", addresses=cluster.addresses)
        replacement.call("hold_parity", members=GROUP, block_bytes=1)
        reply = ask(replacement, "pull_pieces", rank=1, version=1)
        assert not reply["ok"] and "rebuilt" in reply["message"], reply


def test_a_survivor_that_serves_another_state_under_the_version_fails_the_rebuild():
    with Cluster(["a", "b", "c", "d"], k=1, **SETUP) as cluster:
        start_group(cluster, versions=1)
        cluster.peers[2].kill()
        # Rank 3 snapshots version 1 again with other bytes (a re-run that diverged, or a
        # liar): its piece no longer matches what it pushed, and the holder refuses it.
        cluster.peers[3].call("restate", version=1, seed=99)
        reply = ask(cluster.peers[0], "rebuild_piece", lost=2, version=1)
        assert not reply["ok"] and reply["error"] == "ChecksumMismatchError", reply
        assert "rank 3" in reply["message"], reply
        reply = ask(cluster.peers[1], "rebuild_piece", lost=2, version=1)  # also pulls rank 3's piece
        assert not reply["ok"] and "rank 3" in reply["message"], reply

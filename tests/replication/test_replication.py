"""Buddy replication between real processes on 127.0.0.1: pushes, pulls, kill -9."""

import signal
import time
import warnings

import pytest

from helpers.cluster import Cluster, PeerError

pytestmark = pytest.mark.e2e  # several real processes per test: left out of `-m "not e2e"`

SMALL = dict(large_bytes=2 << 20, small_count=2000, small_bytes=1024)  # ~4 MiB in 2002 tensors


@pytest.mark.parametrize("k", [1, 2])
def test_replicate_versions_and_pull_back_bitwise(k):
    nodes = ["node-a", "node-a", "node-b", "node-b"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k=2 on 2 nodes warns that a copy shares its source's node
        cluster = Cluster(nodes, k=k, **SMALL)
    with cluster:
        ranks = range(len(nodes))
        for version in range(1, 11):
            digests = {r: cluster.peers[r].call("step", version=version)["digest"] for r in ranks}
            for r in ranks:
                results = cluster.peers[r].call("wait", version=version)["results"]
                assert results == {str(h): None for h in cluster.holders(r)}, results
            for r in ranks:
                for holder in cluster.holders(r):
                    held = cluster.peers[holder].call("holdings")["holdings"][str(r)]
                    assert held == {"version": version, "digest": digests[r]}, (r, holder)
        # A fresh process per rank, with no state, pulls it back from the holders.
        for r in ranks:
            replacement = cluster.start(r, name=f"replacement{r}")
            replacement.call("connect", addresses=cluster.addresses)
            got = replacement.call("recover", rank=r)
            assert got["version"] == 10
            assert got["digest"] == digests[r]


def test_a_holder_takes_the_rerun_after_a_roll_back():
    # The job rolled back to version 2: the source's re-run of step 3 carries a number
    # its holder already committed (from the abandoned run), so the holder refuses it
    # until it drops that run's versions, as every member does on joining a recovery.
    with Cluster(["a", "b"], k=1, **SMALL) as cluster:
        source, holder = cluster.peers[0], cluster.peers[1]
        for version in (1, 2, 3):
            source.call("step", version=version)
            assert source.call("wait", version=version)["results"] == {"1": None}
        source.call("roll_back", version=2)
        rerun = source.call("step", version=3)["digest"]
        [refused] = source.call("wait", version=3)["results"].values()
        assert "not newer than the committed version 3" in refused
        assert holder.call("drop_newer", version=2)["held"] == {"0": [2]}
        source.call("replicate", version=3)
        assert source.call("wait", version=3)["results"] == {"1": None}
        assert holder.call("holdings")["holdings"]["0"] == {"version": 3, "digest": rerun}
        assert holder.call("drop_newer", version=0)["held"] == {}  # nothing at or below 0 is left
        source.call("replicate", version=3)
        assert source.call("wait", version=3)["results"] == {"1": None}
        assert holder.call("holdings")["holdings"]["0"] == {"version": 3, "digest": rerun}


def test_holder_killed_mid_replication_keeps_survivors_committed():
    with Cluster(["a", "b", "c"], k=2, large_bytes=96 << 20, small_count=10) as cluster:
        source, doomed, survivor = cluster.peers[0], cluster.peers[1], cluster.peers[2]
        v1 = source.call("step", version=1)["digest"]
        assert source.call("wait", version=1)["results"] == {"1": None, "2": None}
        # Both holders frozen: version 2 cannot complete anywhere until they run again.
        doomed.signal(signal.SIGSTOP)
        survivor.signal(signal.SIGSTOP)
        v2 = source.call("step", version=2)["digest"]
        doomed.kill()  # kill -9 while its copy of version 2 is partial
        survivor.signal(signal.SIGCONT)
        results = source.call("wait", version=2, timeout=60)["results"]
        assert results["2"] is None
        assert results["1"] is not None and "PeerConnectionError" in results["1"], results
        held = survivor.call("holdings")["holdings"]["0"]
        assert held == {"version": 2, "digest": v2} and v1 != v2


def test_source_killed_mid_push_partial_version_never_visible():
    with Cluster(["a", "b"], k=1, large_bytes=96 << 20, small_count=10) as cluster:
        source, holder = cluster.peers[0], cluster.peers[1]
        v1 = source.call("step", version=1)["digest"]
        source.call("wait", version=1)
        holder.signal(signal.SIGSTOP)
        source.call("step", version=2)  # its push stalls on the frozen holder
        time.sleep(0.3)
        source.kill()  # dies with version 2 half sent
        holder.signal(signal.SIGCONT)
        time.sleep(0.5)  # the holder drains what was in flight, then sees the connection end
        assert holder.call("holdings")["holdings"]["0"] == {"version": 1, "digest": v1}
        replacement = cluster.start(0, name="replacement")
        replacement.call("connect", addresses=cluster.addresses)
        with pytest.raises(PeerError, match="version 2 of rank 0 is not committed here"):
            replacement.call("recover", rank=0, version=2)
        got = replacement.call("recover", rank=0)
        assert got == {"ok": True, "version": 1, "digest": v1}


@pytest.mark.parametrize("k", [1, 2])
def test_source_killed_mid_pull(k):
    nodes = ["a", "b", "c"]
    with Cluster(nodes, k=k, large_bytes=128 << 20, small_count=10, chunk_bytes=1 << 20) as cluster:
        digest = cluster.peers[0].call("step", version=1)["digest"]
        cluster.peers[0].call("wait", version=1)
        holders = cluster.holders(0)
        assert len(holders) == k
        cluster.peers[0].kill()  # the failure being recovered from
        replacement = cluster.start(0, name="replacement")
        replacement.call("connect", addresses=cluster.addresses)
        doomed = cluster.peers[holders[-1]]
        replacement.call("describe", peer=holders[-1], rank=0)  # its connections are open now
        doomed.signal(signal.SIGSTOP)
        replacement.send("recover", rank=0, sources=holders)
        # Chunks handed to the frozen holder are in progress: the pull cannot end without it.
        assert not replacement.ready(timeout=1.5)
        doomed.kill()
        reply = replacement.reply(timeout=60)
        if k == 2:
            assert reply["ok"], reply
            assert reply["version"] == 1 and reply["digest"] == digest
        else:
            assert not reply["ok"]
            assert reply["error"] == "PeerConnectionError", reply
            assert "no source left" in reply["message"] and "rank 1" in reply["message"], reply


def _replica_group_with_a_replacement(cluster):
    """Ranks 0 and 1 hold the same state (a replica group) at versions 3 and 4;
    rank 0 is killed and a replacement takes its place. Returns (replacement, digest of 3)."""
    digest = cluster.peers[0].call("step", version=3, replicate=False)["digest"]
    assert cluster.peers[1].call("step", version=3, replicate=False)["digest"] == digest
    cluster.peers[1].call("step", version=4, replicate=False)
    cluster.peers[0].kill()
    replacement = cluster.start(0, name="replacement", groups=[[0, 1]], state_rank=0)
    replacement.call("connect", addresses=cluster.addresses)
    return replacement, digest


def test_a_holder_on_this_machine_is_read_from_its_memory():
    with Cluster(["a", "b"], k=1, groups=[[0, 1]], state_rank=0, **SMALL) as cluster:
        replacement, digest = _replica_group_with_a_replacement(cluster)
        holder = cluster.peers[1].call("region", version=3)
        assert holder["address"] != 0
        reply = replacement.call("recover", rank=0, version=3, sources=[1],
                                 same_machine={1: [holder["pid"], holder["address"]]})
        assert reply["ok"] and reply["version"] == 3 and reply["digest"] == digest, reply
        assert reply["chunks_from_memory"] == reply["chunks"] > 1


@pytest.mark.parametrize("wrong", ["unmapped address", "process gone", "another version's region"])
def test_what_cannot_be_read_from_memory_comes_over_tcp(wrong):
    with Cluster(["a", "b"], k=1, groups=[[0, 1]], state_rank=0, **SMALL) as cluster:
        dead_pid = cluster.peers[0].proc.pid
        replacement, digest = _replica_group_with_a_replacement(cluster)
        holder = cluster.peers[1].call("region", version=3)
        source = {"unmapped address": [holder["pid"], 4096],
                  "process gone": [dead_pid, holder["address"]],
                  "another version's region": [holder["pid"], cluster.peers[1].call("region", version=4)["address"]],
                  }[wrong]
        reply = replacement.call("recover", rank=0, version=3, sources=[1], same_machine={1: source})
        assert reply["ok"] and reply["version"] == 3 and reply["digest"] == digest, reply
        assert reply["chunks_from_memory"] == 0


def test_a_version_pulled_again_replaces_the_copy_pulled_before():
    # A recovery superseded after its pull (a second failure) pulls the same recovery
    # point again in the next epoch, into a store that already committed it.
    with Cluster(["a", "b"], k=1, groups=[[0, 1]], state_rank=0, **SMALL) as cluster:
        replacement, digest = _replica_group_with_a_replacement(cluster)
        for _ in range(2):
            reply = replacement.call("recover", rank=0, version=3, sources=[1])
            assert reply["ok"] and reply["version"] == 3 and reply["digest"] == digest, reply


def test_replica_group_pulls_from_peers_with_no_replication_traffic():
    # Ranks 0 and 1 are data-parallel replicas (identical state) on different nodes.
    nodes = ["a", "b"]
    with Cluster(nodes, k=1, groups=[[0, 1]], state_rank=0, **SMALL) as cluster:
        digest = cluster.peers[0].call("step", version=3, replicate=False)["digest"]
        assert cluster.peers[1].call("step", version=3, replicate=False)["digest"] == digest
        assert cluster.peers[1].call("holdings")["holdings"] == {}  # no extra memory anywhere
        cluster.peers[0].kill()
        replacement = cluster.start(0, name="replacement", groups=[[0, 1]], state_rank=0)
        replacement.call("connect", addresses=cluster.addresses)
        assert replacement.call("recover", rank=0) == {"ok": True, "version": 3, "digest": digest}

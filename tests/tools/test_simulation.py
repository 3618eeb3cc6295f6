"""The simulated workers of bench/scale.py: they make a real worker's requests to
the job's store with the worker's own code, and torch's NCCL rendezvous requests
with torch's own TCPStore client, over a real TCPStore."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")

from peerstate.control import keys  # noqa: E402
from peerstate.control.coordinator import Coordinator  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.control.messages import StateLayout  # noqa: E402
from peerstate.tools.simulation import (NCCL_UNIQUE_ID_BYTES, NcclRendezvous, SimulatedNode,  # noqa: E402
                                        buddy_placement, served_by)

NPROC = 2
LAYOUT = StateLayout(k=1, share_count=NPROC, data_parallel=True)


def recover(nnodes):
    """One recovery of a simulated job of ``nnodes`` nodes, its workers simulated: the
    nodes, and the job store's requests of that recovery by client kind."""
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    address, world = f"127.0.0.1:{kv.port}", nnodes * NPROC
    placement = buddy_placement(world, NPROC, 1)
    kv.set_many([(keys.replica_bytes(r), b"4096") for r in range(world)])
    with ThreadPoolExecutor(16) as pool:
        nodes = list(pool.map(lambda n: SimulatedNode(address, n, nnodes, NPROC, served_by(world, NPROC, 1, placement),
                                                      layout=LAYOUT, placement=placement, report_timeout=30.0),
                              range(nnodes)))
    for node in nodes:
        node.connect()
    for node in nodes:
        node.start()
    try:
        for node in nodes:
            node.channel.wait_delivered(0, 20)
        threads = [threading.Thread(target=node.members.run, args=(1, 100)) for node in nodes]
        for thread in threads:
            thread.start()
        before = {n.node: (n.members.kv.count.requests, n.members.rendezvous.count.requests) for n in nodes}
        Coordinator(TorchKeyValueStore("127.0.0.1", kv.port)).report_failure(
            ["n1.0"], "killed", detected_at=time.time(), me="agent1")
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a node's members did not finish the recovery"
        deadline = time.monotonic() + 20  # the marks go through the agents
        while kv.get(keys.recovery_seconds(1)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = sum(n.members.kv.count.requests - before[n.node][0] for n in nodes)
        rendezvous = sum(n.members.rendezvous.count.requests - before[n.node][1] for n in nodes)
        return kv, nodes, workers, rendezvous
    finally:
        for node in nodes:
            node.stop(wait=False)
        for node in nodes:
            node.stop()


@pytest.mark.e2e
def test_simulated_workers_form_the_epochs_group_and_publish_their_marks_at_a_cost_per_rank_that_does_not_grow():
    per_rank = {}
    for nnodes in (4, 16):
        kv, nodes, workers, rendezvous = recover(nnodes)
        world = nnodes * NPROC
        assert all(1 in n.members.ready for n in nodes)
        # every node held its instructions before its members formed the group
        assert all(n.channel.delivered[1] <= n.members.ready[1] for n in nodes)
        # n1.0 held rank 2: a spare took it, and its worker read the DDP layout the survivors published
        assert nodes[1].members._wrappers[2].published_layout(1, 0, 1.0) == [[3, 2], [1, 0]]
        # every node's agent forwarded its members' marks; the last assembled the timeline
        deadline = time.monotonic() + 20
        while kv.get(keys.recovery_seconds(1)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert float(kv.get(keys.recovery_seconds(1))) > 0
        assert kv.add(keys.marks_done(1), 0) == world
        assert all(kv.get(keys.node_marks(1, n.node)) for n in nodes)
        # the rendezvous: rank 0 sets the unique id (1 request); one member of each node waits for and
        # reads it (2), for the node
        assert rendezvous == 1 + 2 * nnodes
        per_rank[nnodes] = workers / world
    # a DDP layout per node, the replacement's few requests; its marks go through the agents
    assert per_rank[16] < per_rank[4] <= 2, per_rank


def test_the_nccl_rendezvous_above_128_ranks_reads_one_unique_id_per_root_once_per_node():
    from peerstate.control.memory_store import InMemoryKeyValueStore
    from peerstate.control.node_rendezvous import node_rendezvous_store

    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    world = 384  # three roots: ranks 0, 128 and 256

    def rendezvous(channel=None, timeout=10.0):
        return NcclRendezvous(node_rendezvous_store(kv.rendezvous_store(), channel, timeout))

    roots = rendezvous()
    for rank in range(world):
        roots.announce(2, rank, world)
    assert roots.count.requests == 3
    alone = rendezvous()  # torch's default: a rank reads for itself
    alone.join(2, 5, world)
    alone.join(2, 6, world)
    assert alone.count.requests == 4  # for each rank, a wait for the three ids and one read of all
    assert alone.count.bytes_received == 2 * 3 * NCCL_UNIQUE_ID_BYTES
    node = rendezvous(InMemoryKeyValueStore())  # a node's members, sharing their node channel
    for rank in range(8, 16):
        node.join(2, rank, world)
    assert node.count.requests == 2 and node.count.bytes_received == 3 * NCCL_UNIQUE_ID_BYTES
    late = rendezvous(InMemoryKeyValueStore(), timeout=0.5)
    with pytest.raises(Exception):  # epoch 3's roots never announced: the read waits, then times out
        late.join(3, 5, world)

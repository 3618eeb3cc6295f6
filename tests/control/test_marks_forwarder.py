"""A recovery's timeline marks, forwarded by each node (``MarksForwarder``, the
relay's step 5) from its channel to the job's store: as soon as the node's last
member has marked its first step, with no relay waiting for a plan, and never
for an epoch a newer one replaced. Stores: the in-memory ``KeyValueStore``."""

import json

from peerstate.control import keys
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.control.node_relay import MarksForwarder
from peerstate.control.timeline import RecoveryTimelines

PLAN = {"epoch": 1, "failed": [1], "replaced": {"1": "n0.2"}, "reason": "rank 1 exited", "detected_at": 100.0,
        "planned_at": 100.1}


def marks(first_step: float) -> bytes:
    return json.dumps({"marks": {"abort": 100.2, "re-form": 100.3, "restore": 100.4, "first step": first_step},
                       "version": 7}).encode()


def node(kv, said, node_index=0):
    timelines = RecoveryTimelines(kv, lambda epoch: dict(PLAN, epoch=epoch), nnodes=2, world_size=4, events=None,
                                  say=said.append)
    channel = InMemoryKeyValueStore()
    return channel, MarksForwarder(channel, timelines, node_index)


def test_a_nodes_marks_go_to_the_store_once_its_last_member_marked_and_the_last_node_assembles_the_timeline():
    kv, said = InMemoryKeyValueStore(), []
    channel0, forwarder0 = node(kv, said, 0)
    channel1, forwarder1 = node(kv, said, 1)
    try:
        forwarder0.forward(1, [0, 1])
        forwarder1.forward(1, [2, 3])
        channel0.set(keys.recovery_marks(1, 0), marks(100.5))
        channel1.set_many([(keys.recovery_marks(1, 2), marks(100.5)), (keys.recovery_marks(1, 3), marks(100.6))])
        kv.wait([keys.node_marks(1, 1)], timeout=30)  # node 1 is complete: published with no relay running
        assert kv.get(keys.node_marks(1, 0)) is None  # node 0 still waits for rank 1
        assert kv.get(keys.recovery_seconds(1)) is None
        channel0.set(keys.recovery_marks(1, 1), marks(100.9))
        kv.wait([keys.recovery_seconds(1)], timeout=30)
        assert kv.add(keys.marks_done(1), 0) == 4
        assert float(kv.get(keys.recovery_seconds(1))) == 100.9 - 100.0  # detection to the last first step
        assert len(said) == 1 and "recovered epoch 1 (ranks [1])" in said[0]
    finally:
        forwarder0.stop()
        forwarder1.stop()


def test_a_newer_epoch_replaces_the_wait_for_an_interrupted_recovery_and_a_stopped_forwarder_starts_again():
    kv, said = InMemoryKeyValueStore(), []
    channel, forwarder = node(kv, said)
    try:
        forwarder.forward(1, [0, 1])
        channel.set(keys.recovery_marks(1, 0), marks(100.5))  # rank 1 never ran epoch 1's first step
        forwarder.forward(2, [0, 1])
        channel.set_many([(keys.recovery_marks(2, 0), marks(101.5)), (keys.recovery_marks(2, 1), marks(101.5))])
        kv.wait([keys.node_marks(2, 0)], timeout=30)
        channel.set(keys.recovery_marks(1, 1), marks(100.5))  # too late: epoch 1 is no longer watched
        forwarder.stop()
        assert kv.get(keys.node_marks(1, 0)) is None
        assert kv.add(keys.marks_done(2), 0) == 2
        forwarder.forward(3, [0])  # a relay started again (an agent that stalled and came back)
        channel.set(keys.recovery_marks(3, 0), marks(102.5))
        kv.wait([keys.node_marks(3, 0)], timeout=30)
    finally:
        forwarder.stop()

"""WorkerContext: the services that need a rank come once, when the process takes
it; using one before, or handing one over twice, is a bug said as such."""

import socket

import pytest

import peerstate
from peerstate.control import keys
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.control.messages import RecoveryPlan
from peerstate.errors import InternalError
from peerstate.worker.context import WorkerContext
from peerstate.worker.membership import EpochWatcher, Membership

SECRET = bytes(range(32))


def _context():
    # a spare's context before it took a rank: only what the tests read is given
    return WorkerContext(Membership("n0.1", spare=True), kv=None, channel=None, coordinator=None, events=None,
                         report=None, placement=None, world_size=2, join_timeout=10, failure_grace=10)


def _replication(store):
    placement = peerstate.BuddyPlacement([0, 1], k=1)
    return peerstate.Replication(store, 0, placement, credentials=peerstate._C.JobAuthority(SECRET).issue(0))


def test_a_service_read_before_the_rank_was_taken_is_an_internal_error():
    context = _context()
    assert not context.ranked
    with pytest.raises(InternalError, match="the replication endpoint was used before this process took a rank"):
        context.replication
    with pytest.raises(InternalError, match="the epoch watcher was used before this process took a rank"):
        context.watcher
    context.close()  # nothing came: nothing to close


def test_each_service_is_handed_over_once_and_closed_with_the_context(store):
    context, channel, epochs = _context(), InMemoryKeyValueStore(), []
    replication = _replication(store)
    watcher = EpochWatcher(channel, RecoveryPlan(1), epochs.append)
    context.serve(replication)
    context.watch(watcher)
    assert context.ranked and context.replication is replication and context.watcher is watcher
    with pytest.raises(InternalError, match="the replication endpoint was handed over a second time"):
        context.serve(replication)
    with pytest.raises(InternalError, match="the epoch watcher was handed over a second time"):
        context.watch(watcher)
    assert context.replication is replication and context.watcher is watcher  # the refused hand-over changed nothing

    address = replication.address
    socket.create_connection(address, timeout=10).close()  # served until the context closes
    context.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=10)
    channel.set(keys.epoch_plan(2), RecoveryPlan(2, failed=[0]).encode())
    assert not watcher.wait_newer(1, 0.2) and epochs == []  # no longer watched

"""The bound a holder puts on the versions pushed to it comes from its own job's
record (``Replication.reached``, and ``drop_newer`` after a roll-back), not from the
sender: two endpoints in this process, a real server and transport on 127.0.0.1."""

import secrets
import warnings

import pytest
import torch

import peerstate


@pytest.fixture
def source_and_holder():
    job = peerstate._C.JobAuthority(secrets.token_bytes(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two ranks on two nodes: nothing to warn of, but be sure
        placement = peerstate.BuddyPlacement(["a", "b"], k=1)
    stores = [peerstate.SnapshotStore(), peerstate.SnapshotStore()]
    for store in stores:
        store.register("x", torch.arange(1000, dtype=torch.float32))
    ends = [peerstate.Replication(stores[0], 0, placement, credentials=job.issue(0), snapshot_every=2),
            peerstate.Replication(stores[1], 1, placement, credentials=job.issue(1), snapshot_every=2)]
    try:
        for end in ends:
            end.connect({r: e.address for r, e in enumerate(ends)})
        ends[1].reserve({0: stores[0].memory()["bytes_per_version"]})
        yield stores[0], ends[0], ends[1]
    finally:
        for end in ends:
            end.close()
        for store in stores:
            store.close()


def push(store, source, version):
    """Push ``version`` of the source's state (snapshotted first, unless it was); its error or None."""
    if version not in store.native.committed_versions():
        store.snapshot(version).wait()
    source.replicate(version)
    [error] = source.wait(version, check=False).values()
    return error


def test_a_holder_takes_versions_up_to_its_step_plus_the_window_and_no_further(source_and_holder):
    store, source, holder = source_and_holder
    window = peerstate.replication.endpoint.VERSION_WINDOW_SNAPSHOTS * 2
    holder.reached(10)
    assert push(store, source, 10 + window) is None
    assert "ahead of what this job has reached" in str(push(store, source, 11 + window))
    holder.reached(11)
    assert push(store, source, 11 + window) is None
    assert holder.holdings() == {0: 11 + window}


def test_a_roll_back_moves_the_bound_back_with_it(source_and_holder):
    store, source, holder = source_and_holder
    window = peerstate.replication.endpoint.VERSION_WINDOW_SNAPSHOTS * 2
    holder.reached(500)
    assert push(store, source, 500) is None
    holder.drop_newer(3)  # the job rolled back to step 3: it is there again
    store.drop_newer(3)
    assert holder.holdings() == {}
    assert push(store, source, 3 + window) is None
    assert "ahead of what this job has reached" in str(push(store, source, 4 + window))

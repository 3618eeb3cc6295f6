"""Replicas held in device memory (GPU nodes). The round trip needs a GPU and is
skipped, visibly, elsewhere; without one, asking for it is a clear error."""

import secrets
import warnings

import pytest
import torch

import peerstate
from peerstate import _C


@pytest.mark.skipif(peerstate.cuda_available(), reason="checks the answer of a machine without a GPU")
def test_device_replicas_without_a_gpu_are_a_clear_error():
    with pytest.raises(peerstate.UnavailableError, match="cannot hold replicas on cuda:0"):
        _C.ReplicaStore(budget_bytes=1 << 30, device=0)
    with pytest.raises(peerstate.InvalidArgumentError, match="explicit budget_bytes"):
        _C.ReplicaStore(device=0)


@pytest.mark.skipif(not peerstate.cuda_available(), reason="no CUDA GPU here "
                    f"(peerstate.cuda_compiled()={peerstate.cuda_compiled()})")
def test_device_replicas_round_trip():
    job = peerstate._C.JobAuthority(secrets.token_bytes(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        placement = peerstate.BuddyPlacement(["a", "b"], k=1)
    source_tensor = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)
    source = peerstate.SnapshotStore(chunk_bytes=4 << 20)
    source.register("x", source_tensor)
    holder = peerstate.SnapshotStore()
    holder.register("x", torch.zeros(16, dtype=torch.uint8))
    ends = [peerstate.Replication(source, 0, placement, credentials=job.issue(0)),
            peerstate.Replication(holder, 1, placement, credentials=job.issue(1), replica_device=0,
                                  replica_budget_bytes=1 << 30)]
    fresh = None
    try:
        addresses = {r: e.address for r, e in enumerate(ends)}
        for e in ends:
            e.connect(addresses)
        ends[1].reserve({0: source.memory()["bytes_per_version"]})
        source.snapshot(1).wait()
        ends[0].replicate(1)
        ends[0].wait(1)
        assert ends[1].holdings() == {0: 1} and ends[1].replicas.device == 0
        assert ends[1].replicas.stored_bytes(0) == bytes(source.stored_bytes(1))
        target = torch.zeros_like(source_tensor)
        store = peerstate.SnapshotStore(chunk_bytes=4 << 20)
        store.register("x", target)
        fresh = peerstate.Replication(store, 0, placement, credentials=job.issue(0))
        fresh.connect({1: ends[1].address})
        assert fresh.recover(0) == 1
        assert torch.equal(target, source_tensor)
    finally:
        for e in ends + ([fresh] if fresh else []):
            e.close()

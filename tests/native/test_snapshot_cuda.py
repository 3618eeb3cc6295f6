"""The device path: CUDA tensors through the same store. Runs only where a GPU exists;
elsewhere every test here is skipped, visibly, with the reason."""

import pytest
import torch

import peerstate

pytestmark = pytest.mark.skipif(
    not (peerstate.cuda_available() and torch.cuda.is_available()),
    reason="no CUDA GPU here (peerstate.cuda_compiled()=%s)" % peerstate.cuda_compiled(),
)


@pytest.mark.parametrize("n", [1, 63, 4097, (8 << 20) + 3])
def test_device_round_trip_odd_sizes(n):
    store = peerstate.SnapshotStore(chunk_bytes=1 << 20)
    try:
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        before = t.clone()
        store.register("t", t)
        store.snapshot(1).wait()
        t.fill_(3)
        store.restore(1)
        assert torch.equal(t, before)
    finally:
        store.close()


def test_device_and_host_mixed_many_small():
    store = peerstate.SnapshotStore()
    try:
        dev = {f"d{i}": torch.randn(16384, device="cuda") for i in range(500)}
        host = {f"h{i}": torch.randn(1000) for i in range(50)}
        store.register_many({**dev, **host})
        saved = {k: v.clone() for k, v in {**dev, **host}.items()}
        store.snapshot(1).wait()
        for v in list(dev.values()) + list(host.values()):
            v.mul_(-2)
        store.restore(1)
        assert all(torch.equal(v, saved[k]) for k, v in {**dev, **host}.items())
    finally:
        store.close()


def test_device_snapshot_follows_the_training_stream():
    store = peerstate.SnapshotStore()
    try:
        t = torch.zeros(64 << 20, device="cuda")
        store.register("t", t)
        torch.cuda.synchronize()
        t.add_(1)  # queued on the current stream, likely still running
        store.snapshot(1).wait()
        t.zero_()
        store.restore(1)
        assert bool((t == 1).all())
    finally:
        store.close()


def test_device_corruption_detected():
    store = peerstate.SnapshotStore(chunk_bytes=1 << 20)
    try:
        t = torch.randn(1 << 20, device="cuda")
        store.register("t", t)
        store.snapshot(1).wait()
        live = t.clone()
        store.stored_bytes(1)[100] ^= 0xFF
        with pytest.raises(peerstate.ChecksumMismatchError):
            store.restore(1)
        assert torch.equal(t, live)
    finally:
        store.close()

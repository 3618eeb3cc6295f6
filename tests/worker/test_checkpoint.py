"""Disk checkpoints on the real DCP writer and reader, in one process: a complete
checkpoint is never written again (a replayed step's save once tore one: the
old .metadata stayed over a half-rewritten file), an incomplete one is, and a
checkpoint that cannot be read stops the job with DCP's cause."""

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

from peerstate import InvalidArgumentError  # noqa: E402
from peerstate.control.coordinator import Coordinator  # noqa: E402
from peerstate.control.memory_store import InMemoryKeyValueStore  # noqa: E402
from peerstate.worker.checkpoint import DiskCheckpoints, latest_checkpoint  # noqa: E402
from peerstate.worker.rebuild import DistributedWrappers  # noqa: E402
from peerstate.worker.tracked_state import TrackedState  # noqa: E402


@pytest.fixture
def setup(tmp_path):
    """(checkpoints, model, coordinator): one rank's tracked Linear, checkpointed under tmp_path."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP without a group: one process
    kv = InMemoryKeyValueStore()
    coordinator = Coordinator(kv)
    tracked = TrackedState([0], k=1, share_count=None, versions=4, threads=1)
    model = torch.nn.Linear(4, 4)
    tracked.track(model=model, optimizer=None, scheduler=None, loader=None, extras={}, data_parallel=False)
    tracked.register(0)
    checkpoints = DiskCheckpoints(tracked, DistributedWrappers(kv), str(tmp_path), 5, coordinator.fail_job)
    yield checkpoints, model, coordinator
    tracked.close()


def _files(path):
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_a_complete_checkpoint_is_not_written_again(setup):
    checkpoints, model, _ = setup
    saved = model.weight.detach().clone()
    checkpoints.save(5, 0)
    step, path = latest_checkpoint(checkpoints.directory)
    before = _files(path)
    with torch.no_grad():
        model.weight.add_(1.0)
    checkpoints.save(5, 0)  # the step replayed: the complete checkpoint stands as it was
    assert step == 5 and _files(path) == before
    checkpoints.load(path, 5, 0)
    assert torch.equal(model.weight, saved)


def test_an_incomplete_checkpoint_is_written_again(setup):
    checkpoints, model, _ = setup
    checkpoints.save(5, 0)
    path = os.path.join(checkpoints.directory, "step_000000005")
    os.unlink(os.path.join(path, ".metadata"))  # a save that did not finish
    for name in os.listdir(path):
        open(os.path.join(path, name), "r+b").truncate(3)
    assert latest_checkpoint(checkpoints.directory) is None
    with torch.no_grad():
        model.weight.add_(1.0)
    expected = model.weight.detach().clone()
    checkpoints.save(5, 0)
    with torch.no_grad():
        model.weight.zero_()
    checkpoints.load(latest_checkpoint(checkpoints.directory)[1], 5, 0)
    assert torch.equal(model.weight, expected)


def test_a_checkpoint_that_cannot_be_read_stops_the_job_with_the_cause(setup):
    checkpoints, model, coordinator = setup
    checkpoints.save(5, 0)
    step, path = latest_checkpoint(checkpoints.directory)
    [data] = [name for name in os.listdir(path) if name.endswith(".distcp")]
    open(os.path.join(path, data), "r+b").truncate(100)  # torn under a .metadata that says complete
    kept = model.weight.detach().clone()
    with pytest.raises(InvalidArgumentError, match=r"rank 0 could not load the disk checkpoint .*step_000000005"):
        checkpoints.load(path, step, 0)
    assert "could not load the disk checkpoint" in coordinator.failure()
    assert torch.equal(model.weight, kept)

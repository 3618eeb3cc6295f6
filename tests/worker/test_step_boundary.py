"""The step boundary: the memory a recovery freed is handed back to the system once
its first step is done, and the order in which each pipeline copies a version and
has it land at the buddy (real stores, a real buddy endpoint on 127.0.0.1)."""

import subprocess
import sys

import pytest

FRAGMENTED_HEAP = """
from peerstate.tools.local import resident_bytes
from peerstate.worker.step_boundary import release_freed_memory
import os
# 64 MiB in 1 KiB chunks (malloc's, not pymalloc's), one in 64 kept: the heap cannot shrink from its top.
chunks = [bytearray(1024) for _ in range(65536)]
kept = chunks[::64]
del chunks
before = resident_bytes(os.getpid())
release_freed_memory()
print(before, resident_bytes(os.getpid()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_memory_freed_among_live_objects_goes_back_to_the_system():
    run = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    before, after = map(int, run.stdout.split())
    assert before - after > 32 * 2**20, (before, after)  # most of the 63 MiB freed


SECRET = bytes(range(32))


@pytest.fixture
def two_ranks():
    """Rank 0's step boundary on its real stores, its buddy rank 1 a real replication
    endpoint on 127.0.0.1 holding its pushes: ``make(versions, model=None)`` -> (boundary, buddy)."""
    torch = pytest.importorskip("torch")
    import peerstate
    from peerstate.control.memory_store import InMemoryKeyValueStore
    from peerstate.control.timeline import EventLog
    from peerstate.worker.checkpoint import DiskCheckpoints
    from peerstate.worker.context import WorkerContext
    from peerstate.worker.membership import Membership
    from peerstate.worker.report import RecoveryReport
    from peerstate.worker.step_boundary import StepBoundary
    from peerstate.worker.tracked_state import TrackedState

    closing = []

    def make(versions, model=None):
        placement = peerstate.BuddyPlacement([0, 1], k=1)
        authority = peerstate._C.JobAuthority(SECRET)
        tracked = TrackedState([0, 1], k=1, share_count=None, versions=versions, threads=1)
        if model is None:  # not "model or": a module with __len__ (Sequential) may be falsy
            model = torch.nn.Linear(2048, 2048)  # 16 MB: a push the test outruns unless it is waited for
        tracked.track(model=model, optimizer=None, scheduler=None, loader=None, extras={}, data_parallel=False)
        tracked.register(0)
        held = peerstate.SnapshotStore(threads=1)
        mine = peerstate.Replication(tracked.own, 0, placement, credentials=authority.issue(0))
        buddy = peerstate.Replication(held, 1, placement, credentials=authority.issue(1))
        addresses = {0: mine.address, 1: buddy.address}
        mine.connect(addresses)
        buddy.connect(addresses)
        buddy.reserve({0: tracked.own.memory()["bytes_per_version"]})
        kv, events = InMemoryKeyValueStore(), EventLog(None, "n0.0")
        membership = Membership("n0.0", spare=False)
        membership.rank = 0
        context = WorkerContext(membership, kv, InMemoryKeyValueStore(), None, events,
                                RecoveryReport(kv, InMemoryKeyValueStore(), events, 2), placement, 2, 10, 10)
        context.serve(mine)
        closing.extend([buddy.close, held.close, context.close, tracked.close])
        return StepBoundary(context, tracked, DiskCheckpoints(tracked, None, None, 0, str), None, 1, versions), buddy

    yield make
    for close in closing:
        close()


def test_the_eager_pipeline_has_each_version_at_the_buddy_before_the_next_optimizer_step(two_ranks):
    # Job(versions=3): a version is committed locally and its push under way when its
    # step's boundary returns, and committed at the buddy when the next step's optimizer
    # pre-hook returns: a rank inside step x is sure of x-2 there (StepBoundary).
    boundary, buddy = two_ranks(3)
    for step in (1, 2, 3):
        boundary.end_step(step, 0.01, 0)
        assert step in boundary.tracked.own.committed_versions()
        assert boundary.replication.replicator.in_flight_version() == step
        boundary.start_replication()
        assert step in buddy.held_versions()[0], (step, buddy.held_versions())
    assert boundary.tracked.own.max_versions == 3


def test_the_lazy_pipeline_starts_a_push_only_at_the_next_optimizer_step(two_ranks):
    # The default (4 versions): the boundary starts nothing; the pre-hook of step v+1
    # starts the push of v, and waits only for the push of v-1.
    boundary, buddy = two_ranks(4)
    boundary.end_step(1, 0.01, 0)
    assert boundary.replication.replicator.in_flight_version() is None
    boundary.start_replication()
    assert boundary.replication.replicator.in_flight_version() == 1
    boundary.end_step(2, 0.01, 0)
    boundary.start_replication()  # waits for version 1's push, starts version 2's
    assert 1 in buddy.held_versions()[0] and boundary.replication.replicator.in_flight_version() == 2


def test_the_synced_pipeline_has_each_version_at_the_buddy_when_the_next_forward_returns(two_ranks, capsys):
    # Job(versions=2): v is copied beside the next forward and pushed once copied; the
    # tracked model's forward in step v+1 returns once v is committed at the buddy (a
    # forward hook), before that step's backward and its collectives, so no rank reaches
    # the boundary of v+1 (which reuses v-1's slot) before v landed everywhere. Two slots: v-1 and v between
    # boundaries, v and v+1 from there on.
    import torch

    boundary, buddy = two_ranks(2)
    model = boundary.tracked.objects["model"]
    boundary.wait_in_forwards([model])  # track(model=[parts]): a hook on each part
    for step in (1, 2, 3):
        boundary.end_step(step, 0.01, 0)  # the copy runs on, and its round starts once it is done
        model(torch.ones(1, 2048))
        assert step in buddy.held_versions()[0], (step, buddy.held_versions())
        model(torch.ones(1, 2048))  # a second microbatch's forward: nothing left to wait for
        boundary.start_replication()  # the optimizer step: waited for already, nothing said
        assert sorted(boundary.tracked.own.committed_versions()) == ([step - 1] if step > 1 else []) + [step]
    assert boundary.tracked.own.max_versions == 2
    assert "forward" not in capsys.readouterr().err


def test_the_synced_pipeline_refuses_a_model_with_no_forward_to_wait_in(two_ranks):
    from peerstate.errors import InvalidArgumentError

    boundary, _ = two_ranks(2)
    with pytest.raises(InvalidArgumentError, match=r"Job\(versions=2\) waits for each version's push when the "
                                                   r"model's forward returns: track\(model=...\) the nn.Module"):
        boundary.wait_in_forwards(None)
    two_ranks(3)[0].wait_in_forwards(None)  # the other pipelines wait at the optimizer step: no model needed


def test_the_synced_pipeline_says_once_when_no_tracked_forward_waited(two_ranks, capsys):
    # A script whose step runs a module it did not track: the round is still waited for
    # at the optimizer step, but after the backward's collectives, so 2 versions no
    # longer guarantee a common step. It is said once, naming the fix.
    boundary, buddy = two_ranks(2)
    for step in (1, 2):
        boundary.end_step(step, 0.01, 0)
        boundary.start_replication()
        assert step in buddy.held_versions()[0]
    said = capsys.readouterr().err
    assert said.count("Job(versions=2) waits for each version's push when the tracked model's forward") == 1, said
    assert "no forward of it ran before the optimizer step after version 1" in said, said


@pytest.mark.parametrize("versions", [4, 2], ids=["lazy", "synced"])
def test_a_norm_layer_waits_for_the_copy_before_its_forward_updates_its_running_statistics(two_ranks, versions):
    # The lazy and synced pipelines copy a version beside the next forward, where BatchNorm
    # updates its running statistics in place: its forward waits for the copy first
    # (StepBoundary.wait_copied_in_norms), so the version holds the statistics of its step.
    import torch

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4096), torch.nn.Linear(4096, 4096))  # 64 MB to copy
    boundary, _ = two_ranks(versions, model)
    boundary.wait_in_forwards(model)
    boundary.wait_copied_in_norms(model)
    own, norm = boundary.tracked.own, model[0]
    committed_at_norm = []
    norm.register_forward_pre_hook(lambda *_: committed_at_norm.append(1 in own.committed_versions()))
    at_step = norm.running_mean.clone()
    boundary.end_step(1, 0.01, 0)  # the copy of 64 MB on one thread runs on beside the forward: without
    model(torch.randn(8, 4096))    # the wait, the norm's forward starts before it is done (unless descheduled)
    assert committed_at_norm == [True]
    assert not torch.equal(norm.running_mean, at_step)  # the forward moved the statistics on
    boundary.start_replication()
    own.restore(1)
    assert torch.equal(norm.running_mean, at_step)  # version 1 holds them as step 1 left them

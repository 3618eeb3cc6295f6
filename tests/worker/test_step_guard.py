"""The step's error classifier and the count that stops a job whose error no spare can
fix (``worker/step_guard.py``), over the in-memory store and a real Coordinator."""

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from peerstate.control import keys  # noqa: E402
from peerstate.control.coordinator import Coordinator  # noqa: E402
from peerstate.control.memory_store import InMemoryKeyValueStore  # noqa: E402
from peerstate.errors import AbortedError, JobFailedError  # noqa: E402
from peerstate.worker.membership import Membership, job_failure  # noqa: E402
from peerstate.worker.peer_failure import raised_by_a_peer_failure  # noqa: E402
from peerstate.worker.step_guard import (  # noqa: E402
    SCRIPT_ERROR_REPEATS, counting_recovery_errors, stop_if_raised_again)


def _raised_from(error, cause):
    try:
        try:
            raise cause
        except BaseException as inner:
            raise error from inner
    except BaseException as outer:
        return outer


@pytest.mark.parametrize("error", [
    dist.DistError("store lost"),
    dist.DistBackendError("NCCL communicator was aborted"),
    AbortedError("a new epoch began"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"),
    RuntimeError("Timed out waiting 30000ms for recv operation to complete"),
    OSError("[Errno 32] Broken pipe"),
    _raised_from(ValueError("the loss is not finite"), dist.DistError("peer gone")),  # the cause decides
])
def test_a_peers_failure_seen_from_here_is_classified_as_one(error):
    assert raised_by_a_peer_failure(error)


@pytest.mark.parametrize("error", [
    ValueError("the loss is not finite"),
    KeyError("batch"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
    ZeroDivisionError("division by zero"),
    _raised_from(TypeError("bad batch"), IndexError("list index out of range")),
])
def test_the_scripts_own_error_is_classified_as_its_own(error):
    assert not raised_by_a_peer_failure(error)


def test_a_cycle_of_causes_ends_the_classification():
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert not raised_by_a_peer_failure(a)


def test_the_same_error_at_the_same_step_stops_the_job_at_the_third_worker_and_not_before():
    kv = InMemoryKeyValueStore()
    coordinator = Coordinator(kv)
    for repeat in range(1, SCRIPT_ERROR_REPEATS):
        stop_if_raised_again(kv, coordinator, rank=2, step=7, error=ValueError("bad batch"))
        assert coordinator.failure() is None, f"stopped after {repeat} of {SCRIPT_ERROR_REPEATS}"
    stop_if_raised_again(kv, coordinator, rank=3, step=7, error=ValueError("bad batch"))  # another rank's
    stop_if_raised_again(kv, coordinator, rank=2, step=8, error=ValueError("bad batch"))  # another step's
    assert coordinator.failure() is None
    stop_if_raised_again(kv, coordinator, rank=2, step=7, error=ValueError("bad batch"))
    failure = coordinator.failure()
    assert failure and "rank 2 raised ValueError: bad batch in step 7" in failure and \
        f"{SCRIPT_ERROR_REPEATS} of its workers" in failure, failure
    assert job_failure(kv) == failure


def test_a_recovery_that_raises_counts_under_the_step_it_leads_to_and_is_raised_again():
    kv = InMemoryKeyValueStore()
    coordinator = Coordinator(kv)
    membership = Membership("n0.1", spare=True)
    with pytest.raises(ValueError):  # a spare with no rank yet: raised, not counted
        with counting_recovery_errors(kv, coordinator, membership, lambda: 5):
            raise ValueError("load_state_dict: missing key")
    membership.rank = 1
    for _ in range(SCRIPT_ERROR_REPEATS):
        with pytest.raises(ValueError):
            with counting_recovery_errors(kv, coordinator, membership, lambda: 5):
                raise ValueError("load_state_dict: missing key")
    failure = coordinator.failure()
    assert failure and "in its recovery (to run step 5 next)" in failure, failure
    with pytest.raises(JobFailedError):  # the job's own stop is not a script error: not counted again
        with counting_recovery_errors(kv, coordinator, membership, lambda: 6):
            raise JobFailedError("the job stopped")
    assert kv.get(keys.script_errors(1, 6)) is None
    assert coordinator.failure() == failure

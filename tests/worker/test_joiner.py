"""An epoch's group formation that times out on a member that never came (it froze,
or died, in the rendezvous): the joining member waits for that member's failure to
be declared and joins the next epoch, instead of exiting and costing the job a
spare; with no failure declared within ``failure_grace`` the timeout is raised."""

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from peerstate.control import keys  # noqa: E402
from peerstate.control.coordinator import Coordinator  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.control.messages import RecoveryPlan  # noqa: E402
from peerstate.errors import TimeoutError as PeerstateTimeoutError  # noqa: E402
from peerstate.worker.joiner import EpochJoiner, Superseded  # noqa: E402
from peerstate.worker.membership import EpochWatcher  # noqa: E402
from peerstate.worker.process_groups import ProcessGroups  # noqa: E402

CONNECT_TIMEOUT = 0.2  # gloo gives up on the missing member within 5 x this


@pytest.fixture
def joiner(monkeypatch):
    """Rank 0 of a 2-rank job joining epoch 1, through a real store and real gloo
    groups; rank 1 never arrives. Only the collaborators a formation uses are given."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
    groups = ProcessGroups("gloo", connect_timeout=CONNECT_TIMEOUT)
    joiner = EpochJoiner(membership=None, kv=kv, channel=None, coordinator=Coordinator(kv), groups=groups,
                         tracked=None, restorer=None, boundary=None, wrappers=None, checkpoints=None, report=None,
                         events=None, placement=None, world_size=2, join_timeout=10, failure_grace=10)
    joiner.watcher = EpochWatcher(kv.clone(), RecoveryPlan(1), lambda plan: groups.abort(plan.epoch))
    yield joiner
    joiner.watcher.stop()
    groups.destroy()


def test_a_formation_that_times_out_waits_for_the_missing_members_failure_and_joins_the_next_epoch(joiner):
    declare_after = 5 * CONNECT_TIMEOUT + 2.0  # well after the formation gave up
    declared = []

    def declare_rank_1_failed():
        time.sleep(declare_after)
        declared.append(time.monotonic())
        joiner.kv.set(keys.epoch_plan(2), RecoveryPlan(2, failed=[1], reason="rank 1 hung").encode())

    declarer = threading.Thread(target=declare_rank_1_failed)
    started = time.monotonic()
    declarer.start()
    try:
        with pytest.raises(Superseded):
            joiner._form(1, rank=0)
    finally:
        declarer.join()
    assert time.monotonic() - started >= declare_after and joiner.watcher.latest.epoch == 2


def test_a_formation_that_times_out_with_no_failure_declared_raises_the_timeout(joiner):
    joiner.failure_grace = 0.5
    with pytest.raises(PeerstateTimeoutError, match="forming the process group of epoch 1 failed"):
        joiner._form(1, rank=0)
    assert joiner.watcher.latest.epoch == 1

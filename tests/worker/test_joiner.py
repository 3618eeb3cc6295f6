"""An epoch's group formation that times out on a member that never came: the
joining member does not exit (a spare lost for nothing). It joins the epoch that
declares the member lost, or, when none comes (a member was late, not lost), asks
for a regroup: the same members form the group again in a new epoch; after a few
such timeouts in a row the timeout is raised. Real gloo groups, a real store."""

import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from peerstate.control import keys  # noqa: E402
from peerstate.control.coordinator import Coordinator  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.control.messages import RecoveryPlan  # noqa: E402
from peerstate.control.timeline import EventLog, read_events  # noqa: E402
from peerstate.errors import TimeoutError as PeerstateTimeoutError  # noqa: E402
from peerstate.worker import joiner as joiner_module  # noqa: E402
from peerstate.worker.context import WorkerContext  # noqa: E402
from peerstate.worker.joiner import EpochJoiner, Superseded  # noqa: E402
from peerstate.worker.membership import EpochWatcher, Membership  # noqa: E402
from peerstate.worker.process_groups import ProcessGroups  # noqa: E402
from peerstate.worker.regroup import BusyPeerRegroup  # noqa: E402

CONNECT_TIMEOUT = 0.2  # gloo gives up on the missing member within 5 x this


@pytest.fixture
def joiner(monkeypatch, tmp_path):
    """Rank 0 (worker n0.0) of a 2-rank job joining epoch 1, through a real store and
    real gloo groups; rank 1 never arrives. Only the collaborators a formation uses
    are given."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
    kv.set(keys.CONFIG, json.dumps({"nnodes": 1, "nproc_per_node": 2, "world_size": 2}).encode())
    coordinator = Coordinator(kv)
    coordinator.start("agent0")
    groups = ProcessGroups("gloo", connect_timeout=CONNECT_TIMEOUT)
    events = EventLog(str(tmp_path / "events.jsonl"), "n0.0")
    regroup = BusyPeerRegroup(coordinator, groups, events, "agent0", "n0.0", world_size=2, abort_timeout=10,
                              join_timeout=10)
    context = WorkerContext(Membership("n0.0", spare=False), kv, channel=None, coordinator=coordinator, events=events,
                            report=None, placement=None, world_size=2, join_timeout=10, failure_grace=10)
    joiner = EpochJoiner(context, groups, tracked=None, restorer=None, boundary=None, wrappers=None, checkpoints=None,
                         regroup=regroup)
    kv.set(keys.epoch_plan(1), RecoveryPlan(1, failed=[1], writer="agent0").encode())
    context.watch(EpochWatcher(kv.clone(), RecoveryPlan(1), lambda plan: groups.abort(plan.epoch)))
    yield joiner
    joiner.watcher.stop()
    groups.destroy()


def test_a_formation_that_times_out_joins_the_epoch_that_declares_the_missing_member_lost(joiner):
    declared = threading.Timer(0.6, lambda: joiner.context.kv.set(
        keys.epoch_plan(2), RecoveryPlan(2, failed=[1], reason="rank 1 was killed").encode()))
    declared.start()  # after the formation gave up (0.2 s), within FORMATION_GRACE
    try:
        with pytest.raises(Superseded):
            joiner._form(1, rank=0)
    finally:
        declared.join()
    latest = joiner.watcher.latest
    assert latest.epoch == 2 and latest.failed == [1]  # the failure's epoch, no regroup


def test_a_formation_that_times_out_with_nobody_lost_is_formed_again_in_a_regroup(joiner):
    started = time.monotonic()
    with pytest.raises(Superseded):
        joiner._form(1, rank=0)
    assert time.monotonic() - started >= joiner_module.FORMATION_GRACE
    regroup = joiner.watcher.latest
    assert regroup.epoch == 2 and regroup.failed == [] and regroup.replaced == {}
    assert "no member was declared lost (one was late)" in regroup.reason and "forming the process group" in \
        regroup.reason
    said = [e for e in read_events(joiner.context.events.path) if e["event"] == "regroup"]
    assert [(e["epoch"], e["cause"]) for e in said] == [(2, "formation timeout")]


def test_formation_timeouts_in_a_row_that_no_loss_explains_raise_the_timeout(joiner, monkeypatch):
    monkeypatch.setattr(joiner_module, "FORMATION_GRACE", 0.05)
    for epoch in range(1, 1 + joiner_module.MAX_FORMATION_REGROUPS):
        with pytest.raises(Superseded):
            joiner._form(epoch, rank=0)
        assert joiner.watcher.latest.epoch == epoch + 1
    with pytest.raises(PeerstateTimeoutError, match="forming the process group of epoch"):
        joiner._form(1 + joiner_module.MAX_FORMATION_REGROUPS, rank=0)


def test_a_recovery_forms_under_a_shorter_connect_timeout_that_doubles_after_each_late_member(joiner, monkeypatch):
    """A member late to a recovery's formation holds the others until the formation is
    given up, one connect timeout with no group formed: a recovery gives up after a
    shorter one than the job's, and a formation that times out with nobody lost (a slow
    machine) doubles it."""
    monkeypatch.setattr(joiner_module, "FORMATION_GRACE", 0.05)
    joiner.groups.connect_timeout = 1.6  # the job's, the ceiling
    joiner.recovery_connect_timeout = 0.1
    started = time.monotonic()
    with pytest.raises(Superseded):
        joiner._form(1, rank=0)
    assert time.monotonic() - started < 5 * 1.6  # gave up before the job's could have ended
    assert joiner.recovery_connect_timeout == 0.2
    for epoch, doubled in ((2, 0.4), (3, 0.8), (4, 1.6)):
        joiner._formation_timeouts = 0  # the members' own limit on regroups in a row is not tested here
        with pytest.raises(Superseded):
            joiner._form(epoch, rank=0)
        assert joiner.recovery_connect_timeout == doubled
    joiner._formation_timeouts = 0
    with pytest.raises(Superseded):
        joiner._form(5, rank=0)
    assert joiner.recovery_connect_timeout == 1.6  # never past the job's

"""The abort path's deadline: the training loop must come into a recovery within
``abort_timeout`` of the first abort it has not answered, and the deadline's
timer thread ends when it does (a timer left to run out kept a thread per
recovery in every survivor for the whole timeout)."""

import subprocess
import sys
import threading
import time

from peerstate.control.environment import ABORT_DEADLINE_EXIT_CODE
from peerstate.control.messages import RecoveryPlan
from peerstate.control.timeline import EventLog
from peerstate.worker.abort import AbortHandler
from peerstate.worker.membership import MemberState, Membership


def _active_member() -> Membership:
    member = Membership("n0.0", spare=False)
    member.rank, member.epoch = 0, 0
    member.begin_join()
    member.end_join()
    assert member.state is MemberState.ACTIVE
    return member


def _timers() -> int:
    return sum(isinstance(t, threading.Timer) and t.is_alive() for t in threading.enumerate())


def test_each_recovery_the_loop_arrives_at_ends_its_deadline_thread():
    member = _active_member()
    aborted = []
    handler = AbortHandler(member, [aborted.append], EventLog(None, "test"), timeout=60.0)
    before = _timers()
    for epoch in range(1, 6):
        handler.on_new_epoch(RecoveryPlan(epoch=epoch))
        assert aborted[-1] == epoch and _timers() == before + 1  # the loop has a deadline now
        handler.loop_arrived()
        member.begin_join()
        member.epoch = epoch
        member.end_join()
        deadline = time.monotonic() + 5
        while _timers() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _timers() == before, f"a deadline thread outlived epoch {epoch}'s arrival"


def test_an_abort_while_the_loop_is_joining_sets_no_deadline():
    member = _active_member()
    handler = AbortHandler(member, [lambda epoch: None], EventLog(None, "test"), timeout=60.0)
    before = _timers()
    member.begin_join()  # the loop is in its recovery of epoch 1 when epoch 2 begins
    handler.on_new_epoch(RecoveryPlan(epoch=2))
    assert _timers() == before


LOOP_THAT_NEVER_ARRIVES = """
import sys, time
from peerstate.control.messages import RecoveryPlan
from peerstate.control.timeline import EventLog
from peerstate.worker.abort import AbortHandler
from peerstate.worker.membership import Membership
member = Membership("n0.0", spare=False)
member.rank, member.epoch = 0, 0
member.begin_join(); member.end_join()
handler = AbortHandler(member, [lambda epoch: None], EventLog(None, "test"), timeout=float(sys.argv[1]))
handler.on_new_epoch(RecoveryPlan(epoch=1))
time.sleep(float(sys.argv[1]) / 2)
handler.on_new_epoch(RecoveryPlan(epoch=2))  # a second abort does not move the deadline
time.sleep(30)
"""


def test_a_loop_that_never_arrives_exits_at_the_first_aborts_deadline():
    # A real process: the deadline ends it with os._exit. Epoch 1's deadline is the one that
    # fires (a second abort restarting it would name epoch 2).
    run = subprocess.run([sys.executable, "-c", LOOP_THAT_NEVER_ARRIVES, "1.0"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == ABORT_DEADLINE_EXIT_CODE, run.stderr
    assert "did not leave its call within abort_timeout=1s of epoch 1's abort" in run.stderr, run.stderr

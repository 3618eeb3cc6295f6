"""The abort path: when a new epoch begins, make the training loop's blocked
calls fail now, and give the loop a deadline to come into the recovery."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from typing import Callable, Optional, Sequence

from peerstate.control.environment import ABORT_DEADLINE_EXIT_CODE
from peerstate.control.messages import RecoveryPlan
from peerstate.control.timeline import EventLog
from peerstate.worker.membership import MemberState, Membership


class AbortHandler:
    """Called by the ``EpochWatcher`` thread for each new plan (``on_new_epoch``).

    ``abort_all`` are called under ``membership.lock`` and must not block long:
    the process groups' abort and the replication transfers' abort.

    The loop can be first: a peer's death fails its collective, it sees the plan
    and joins the epoch before this thread gets the CPU. Aborting then would hit
    the epoch's fresh transports and group, so under the lock (which the join
    holds while it replaces them) an epoch already joined is left alone.

    The deadline (``timeout`` seconds from the first abort the loop has not yet
    answered) is one timer thread, ended by ``loop_arrived()``: a timer left to
    run out kept a thread, and its stack and allocator arena, for ``timeout``
    seconds after every recovery (a survivor's memory grew with the faults).
    """

    def __init__(self, membership: Membership, abort_all: Sequence[Callable[[int], None]], events: EventLog,
                 timeout: float, on_abort: Callable[[], None] = lambda: None) -> None:
        self._membership = membership
        self._abort_all = abort_all
        self._events = events
        self.timeout = timeout
        self._on_abort = on_abort
        self._deadline: Optional[threading.Timer] = None  # pending until the loop comes into the recovery

    def on_new_epoch(self, plan: RecoveryPlan) -> None:
        membership = self._membership
        with membership.lock:
            if membership.epoch >= plan.epoch:
                return
            self._on_abort()
            # A loop already joining needs no deadline (its join has its own bounds), and one
            # still pending keeps counting from the first abort the loop left unanswered.
            if membership.state is not MemberState.JOINING and self._deadline is None:
                self._deadline = threading.Timer(self.timeout, self._deadline_passed, args=(plan.epoch,))
                self._deadline.daemon = True
                self._deadline.start()
            for abort in self._abort_all:
                abort(plan.epoch)
        self._events.write("epoch_seen", epoch=plan.epoch, rank=membership.rank)

    def loop_arrived(self) -> None:
        """The training loop came into the recovery: end the pending deadline, if any
        (called by the loop before it joins)."""
        with self._membership.lock:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

    def _deadline_passed(self, epoch: int) -> None:
        """Timer thread: the loop has not left its call since ``epoch`` began. The
        other members wait for this rank's report; better a spare in its place now
        than all of them at their join timeout."""
        membership = self._membership
        if membership.state in (MemberState.JOINING, MemberState.FINISHED, MemberState.CLOSED) or \
                membership.epoch >= epoch:
            with membership.lock:
                self._deadline = None
            return
        message = (f"rank {membership.rank}: the training loop did not leave its call within abort_timeout="
                   f"{self.timeout:g}s of epoch {epoch}'s abort; this process exits so that a spare takes "
                   "its place")
        self._events.write("abort_deadline_missed", epoch=epoch, rank=membership.rank)
        print(f"peerstate: {message}; where each thread was:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(ABORT_DEADLINE_EXIT_CODE)

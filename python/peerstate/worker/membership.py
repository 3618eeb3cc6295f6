"""A worker's membership in the job: its lifecycle as an explicit state, its
rank, epoch and step counter, and the watcher that learns of each new epoch."""

from __future__ import annotations

import enum
import math
import threading
from typing import Callable, Dict, FrozenSet, Optional, Tuple

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.messages import RecoveryPlan
from peerstate.errors import InternalError, JobFailedError


class MemberState(enum.Enum):
    SPARE = "spare"              # waiting for a rank
    JOINING = "joining"          # the main thread is joining an epoch (the first, or a recovery)
    NEEDS_STATE = "needs state"  # joined as a replacement; its state is pulled once track() registered it
    ACTIVE = "active"            # in the training loop, holding the recovery point's state or newer
    RECOVERING = "recovering"    # a failure interrupted a step; the loop will join the next epoch
    FINISHED = "finished"        # the loop is done; the last round of replication drains
    CLOSED = "closed"


_ALLOWED: Dict[MemberState, FrozenSet[MemberState]] = {
    MemberState.SPARE: frozenset({MemberState.JOINING}),
    MemberState.JOINING: frozenset({MemberState.JOINING, MemberState.ACTIVE, MemberState.NEEDS_STATE}),
    MemberState.NEEDS_STATE: frozenset({MemberState.ACTIVE, MemberState.JOINING}),
    MemberState.ACTIVE: frozenset({MemberState.RECOVERING, MemberState.JOINING, MemberState.FINISHED}),
    MemberState.RECOVERING: frozenset({MemberState.JOINING}),
    MemberState.FINISHED: frozenset(),
    MemberState.CLOSED: frozenset(),
}


def allowed(current: MemberState, new: MemberState) -> bool:
    """Whether a member may go from ``current`` to ``new`` (any state may close)."""
    return new is MemberState.CLOSED or new in _ALLOWED[current]


class Membership:
    """This process's rank, epoch, lifecycle state and step counter. ``lock`` orders
    the watcher's aborts with the main thread's joins of epochs (see ``AbortHandler``).

    ``next_step``, the step the loop runs next, moves only three ways, each on the main
    thread: a step ended cleanly (``step_done``), a join rolled the member back to a
    recovery point (``rolled_back_to``), or a new job resumed from a disk checkpoint
    before its first step (``resumed_at``); anything else is a peerstate bug
    (InternalError), never a silently skipped or repeated step."""

    def __init__(self, worker: str, spare: bool) -> None:
        self.worker = worker
        self.state = MemberState.SPARE if spare else MemberState.JOINING
        self.rank: Optional[int] = None
        self.epoch = -1
        self.replacement = spare  # joined to take a failed rank's place (its state comes from peers)
        self.lock = threading.Lock()
        self._joining_without_state = False  # JOINING's part of needs_state
        self._next_step = 0

    @property
    def next_step(self) -> int:
        return self._next_step

    def step_done(self, step: int) -> None:
        """Step ``step`` ended cleanly, its boundary run: the loop runs the next one."""
        if step != self._next_step:
            raise InternalError(f"peerstate bug: step {step} ended, but step {self._next_step} was the one to run")
        self._next_step = step + 1

    def rolled_back_to(self, version: int) -> int:
        """A join restores the recovery point ``version``: the loop runs the step after it
        (a replacement's moves forward, a survivor's back). Returns the steps that run
        again (those that had completed after the recovery point's own step)."""
        if self.state is not MemberState.JOINING:
            raise InternalError(f"peerstate bug: a member that is {self.state.value}, not joining, rolled back")
        replayed = max(0, self._next_step - version - 2)
        self._next_step = version + 1
        return replayed

    def resumed_at(self, step: int) -> None:
        """A new job resumed from a disk checkpoint: its first step is ``step``."""
        if self._next_step != 0:
            raise InternalError(f"peerstate bug: a resume at step {step} after step {self._next_step - 1} ran")
        self._next_step = step

    def move(self, new: MemberState) -> None:
        """Go to ``new``; InternalError for a transition the lifecycle does not allow."""
        if self.state is new:
            return
        if not allowed(self.state, new):
            raise InternalError(f"peerstate bug: a member cannot go from {self.state.value} to {new.value}")
        self.state = new

    @property
    def needs_state(self) -> bool:
        """It holds none of the job's state yet: a spare, a replacement not yet
        restored, or one joining (again, after a superseded epoch) before its restore."""
        if self.state is MemberState.JOINING:
            return self._joining_without_state
        return self.state in (MemberState.SPARE, MemberState.NEEDS_STATE)

    def begin_join(self) -> bool:
        """Enter JOINING (from any state that may); returns whether it joins without state."""
        without = self.needs_state
        self.move(MemberState.JOINING)
        self._joining_without_state = without
        return without

    def restored(self) -> None:
        """Its state is at the recovery point now (pulled, or loaded from a checkpoint)."""
        if self.state is MemberState.JOINING:
            self._joining_without_state = False
        elif self.state is MemberState.NEEDS_STATE:
            self.move(MemberState.ACTIVE)

    def end_join(self) -> None:
        """The join is done: ACTIVE if it holds the recovery point's state, else
        NEEDS_STATE until ``restored()``."""
        self.move(MemberState.NEEDS_STATE if self._joining_without_state else MemberState.ACTIVE)
        self._joining_without_state = False


def job_failure(channel: KeyValueStore) -> Optional[str]:
    """Why the job stopped, once this worker's agent has seen it (None before): the
    agent copies the job's failure into its node channel, so a worker that checks
    for it while it waits puts no load on the job's store."""
    raw = channel.get(keys.JOB_FAILED)
    return raw.decode() if raw else None


def wait_for_assignment(channel: KeyValueStore, worker: str, timeout: float,
                        poll: float = 5.0) -> Tuple[RecoveryPlan, int, bytes]:
    """A spare's wait for a rank: the first plan that gives one to ``worker``, that
    rank, and its certificate of the rank (its agent puts it in the channel before
    the plan; waited for up to ``timeout`` seconds all the same). The agent copies
    every plan into the node channel in order, and a plan names the spares it
    takes, so the wait reads nothing of the job's store (a worker name is never
    reused: no plan before the spare started names it).
    Blocks until then; JobFailedError once the job's failure is in the channel
    (looked for every ``poll`` seconds)."""
    def stopped() -> bool:
        failure = job_failure(channel)
        if failure:
            raise JobFailedError(f"the job stopped while this spare waited: {failure}")
        return False

    epoch = 1
    while True:
        channel.wait_until([keys.epoch_plan(epoch)], math.inf, moot=stopped, poll=poll)
        plan = RecoveryPlan.decode(channel.get(keys.epoch_plan(epoch)))
        for rank, taker in plan.replaced.items():
            if taker == worker:
                key = keys.rank_certificate(worker, rank)
                channel.wait([key], timeout=timeout)
                return plan, rank, channel.get(key)
        epoch += 1


# How long the watcher's one wait lasts: a plan ends it at once, and stop() interrupts it (its
# connection is a clone: KeyValueStore.interrupt), so the bound matters only for a connection
# that cannot be interrupted. A loopback request to the node's agent, never to the job's store.
WATCH_WAIT_SECONDS = 1.0


class EpochWatcher:
    """Blocks on the next epoch's plan key (its own store connection, the node
    channel) and calls ``on_epoch(plan)`` from its thread the moment the plan
    appears."""

    def __init__(self, kv: KeyValueStore, plan: RecoveryPlan, on_epoch: Callable[[RecoveryPlan], None]) -> None:
        self._kv = kv
        self._latest = plan
        self._on_epoch = on_epoch
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peerstate-epoch-watcher", daemon=True)
        self._thread.start()

    @property
    def latest(self) -> RecoveryPlan:
        with self._changed:
            return self._latest

    def wait_newer(self, epoch: int, timeout: float) -> bool:
        """True once an epoch newer than ``epoch`` is known (False after ``timeout``)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._latest.epoch > epoch, timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            key = keys.epoch_plan(self._latest.epoch + 1)
            try:
                self._kv.wait([key], timeout=WATCH_WAIT_SECONDS)
                plan = RecoveryPlan.decode(self._kv.get(key))
            except TimeoutError:
                continue
            except Exception:  # noqa: BLE001 - the store went away: the job is over
                return
            with self._changed:
                self._latest = plan
                self._changed.notify_all()
            self._on_epoch(plan)

    def stop(self) -> None:
        self._stop.set()
        self._kv.interrupt()
        self._thread.join(timeout=3.0)

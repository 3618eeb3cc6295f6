"""A step's guard (``Job.guard``): what ends a step cleanly, what turns a failure
inside it into a recovery, what tells the script's own error from a peer's
failure seen from here, and what is checked before each step."""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator

from peerstate.control import keys
from peerstate.control.findings import UNGUARDED, UNGUARDED_DRAW, report_finding
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog
from peerstate.errors import JobFailedError
from peerstate.worker.context import WorkerContext
from peerstate.worker.joiner import EpochJoiner
from peerstate.worker.membership import MemberState, Membership
from peerstate.worker.peer_failure import raised_by_a_peer_failure
from peerstate.worker.step_boundary import StepBoundary
from peerstate.worker.tracked_state import TrackedState
from peerstate.worker.unguarded import UnguardedCollectives, UnguardedDraws

if TYPE_CHECKING:
    from peerstate.control.coordinator import Coordinator
    from peerstate.worker.regroup import BusyPeerRegroup


# Workers of one rank that raised their own error in the same step (or in the recovery
# before it): then the job stops. Each replacement replays the step, and runs the same
# recovery; a script that fails there every time would take every spare in turn.
SCRIPT_ERROR_REPEATS = 3


def stop_if_raised_again(kv: KeyValueStore, coordinator: "Coordinator", rank: int, step: int,
                         error: BaseException, where: str = "") -> None:
    """Count the script's own error in ``step`` (in the job's store: the replacement
    that replays the step may be on another node) and stop the job at the
    SCRIPT_ERROR_REPEATS-th: a deterministic error, which no spare can fix.
    ``where``: where in the step it was raised, for the message (its body when empty)."""
    repeats = kv.add(keys.script_errors(rank, step), 1)
    if repeats >= SCRIPT_ERROR_REPEATS:
        where = where or f"in step {step}"
        coordinator.fail_job(f"rank {rank} raised {type(error).__name__}: {str(error)[:300]} {where}, and "
                             f"{repeats} of its workers have now raised there (each replacement ran it again and "
                             "raised again): an error no spare can fix. The job stops rather than hand the rank "
                             "to every spare in turn; the traceback is in the rank's log")


@contextlib.contextmanager
def counting_recovery_errors(kv: KeyValueStore, coordinator: "Coordinator", membership: Membership,
                             next_step: Callable[[], int]) -> Iterator[None]:
    """Around a member's recovery (its join, restore and rebuild, and for a replacement
    the script's own ``load_state_dict``s it calls): an error that escapes ends the
    process, and its rank's next spare runs the same recovery. Counted as a step's
    errors are (``stop_if_raised_again``), under the step the recovery leads to, so that
    a recovery that fails in every replacement stops the job, saying why, instead of
    using up the spares, refilled, for ever, each said only as an exit."""
    try:
        yield
    except JobFailedError:
        raise
    except Exception as error:
        if membership.rank is not None:
            step = next_step()
            stop_if_raised_again(kv, coordinator, membership.rank, step, error,
                                 where=f"in its recovery (to run step {step} next)")
        raise


class StepGuard:
    """One step's body (``Job.guard``): on a clean exit the step boundary runs; a
    failure inside, once the coordinator declared it, becomes a recovery. The
    script's own error (``raised_by_a_peer_failure`` says no, and no failure is
    declared yet) is raised at once: its rank exits and its agent hands it to a spare,
    in the time of a kill, where waiting ``failure_grace`` for a plan that only its
    own death would bring held every other rank that long."""

    def __init__(self, context: WorkerContext, joiner: EpochJoiner, boundary: StepBoundary,
                 regroup: "BusyPeerRegroup", ended: Callable[[int], None]) -> None:
        """``ended(epoch)`` is called once a step ended cleanly, its boundary run."""
        self._context, self._joiner, self._boundary = context, joiner, boundary
        self._membership, self._events = context.membership, context.events
        self._regroup, self._ended = regroup, ended

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool:
        joiner = self._joiner
        step, epoch = self._membership.next_step, self._membership.epoch
        if exc_type is None and self._context.watcher.latest.epoch == epoch:
            try:
                self._boundary.end_step(step, time.monotonic() - self.started, epoch)
                self._membership.step_done(step)
                self._ended(epoch)
                return False
            except Exception:  # noqa: BLE001 - a failure during the boundary is a failure too
                if not joiner.failure_declared(epoch):
                    raise
        elif exc_type is not None:
            if not issubclass(exc_type, Exception):
                return False  # KeyboardInterrupt, SystemExit
            if not raised_by_a_peer_failure(exc) and self._context.watcher.latest.epoch == epoch:
                self._events.write("step_raised", step=step, epoch=epoch, rank=self._membership.rank,
                                   error=f"{exc_type.__name__}: {str(exc)[:200]}")
                stop_if_raised_again(self._context.kv, self._context.coordinator, self._membership.rank, step, exc)
                return False
            self._regroup.note(exc, epoch, self._membership.rank)
            if not joiner.failure_declared(epoch) and \
                    not self._regroup.after(exc, self._context.watcher, epoch, self._membership.rank, step):
                return False  # no failure was declared: a genuine error in the loop
        self._events.write("step_interrupted", step=step, epoch=epoch,
                           error=f"{exc_type.__name__}: {str(exc)[:200]}" if exc_type else None)
        self._membership.move(MemberState.RECOVERING)
        return True


class StepChecks:
    """What ``Job.guard`` finds before a step that the run's owner must hear of: a
    replacement's RNG states changed between its restore and its first step, and
    collectives run, or random numbers drawn, between two guards. Each is said in the
    worker's log and, as a finding, on its agent's console and in the run's summary
    (``control.findings``)."""

    def __init__(self, membership: Membership, tracked: TrackedState, unguarded: UnguardedCollectives,
                 channel: KeyValueStore, events: EventLog) -> None:
        self._membership, self._tracked, self.unguarded = membership, tracked, unguarded
        self.draws = UnguardedDraws()
        self._channel, self._events = channel, events

    def before_step(self, step: int) -> None:
        rank, worker = self._membership.rank, self._membership.worker
        moved = self._tracked.rng_changed()
        if moved:
            cause = (f"it was restored to step {step - 1} inside track(), RNG states included, and they "
                     f"changed before its first step (moved: {', '.join(moved)}): a seed set (torch.manual_seed, random.seed, numpy.random.seed) "
                     "or a random draw made after track() (a batch prefetched across steps draws too) replaced "
                     "them. Seed before Job() and track(), or draw from a generator seeded by the step "
                     "(docs/training-script.md, 'What a training script must and must not do').")
            print(f"peerstate: rank {rank} {cause}", file=sys.stderr, flush=True)
            self._events.write("rng_changed_after_restore", rank=rank, step=step, generators=moved)
            report_finding(self._channel, rank, worker, step, cause)
            warnings.warn(cause, RuntimeWarning, stacklevel=3)
        for found, kind in ((self.unguarded.cause(self._membership.epoch, step), UNGUARDED),
                            (self.draws.cause(self._membership.epoch, step), UNGUARDED_DRAW)):
            if found:
                print(f"peerstate: rank {rank}: {found}", file=sys.stderr, flush=True)
                report_finding(self._channel, rank, worker, step, found, kind=kind)

    def step_ended(self, epoch: int) -> None:
        """A step's guard ended cleanly: what the next guard compares with."""
        self.unguarded.mark(epoch)
        self.draws.mark(epoch)

"""The step boundary: what happens at the end of each guarded step (snapshot,
checkpoint, accounting), and before the next ``optimizer.step()`` (the
snapshot must be complete; its replication starts)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.progress import ProgressCounter
from peerstate.control.timeline import EventLog
from peerstate.errors import AbortedError
from peerstate.replication.endpoint import Replication
from peerstate.replication.placement import BuddyPlacement
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.membership import MemberState, Membership
from peerstate.worker.report import RecoveryReport
from peerstate.worker.tracked_state import TrackedState

if TYPE_CHECKING:
    from peerstate.control.coordinator import Coordinator
    from peerstate.worker.joiner import EpochJoiner
    from peerstate.worker.regroup import BusyPeerRegroup


try:
    _malloc_trim: Any = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


def release_freed_memory() -> None:
    """Give the heap memory a recovery freed back to the system (glibc's malloc_trim;
    nothing elsewhere). A recovery frees the aborted epoch's process groups, transports
    and transfer buffers, allocated among longer-lived objects; glibc keeps such free
    chunks in its heaps (a survivor's main heap grew ~0.9 MB a recovery). ~2 ms, after
    the recovery's first step."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def publish_size(kv: KeyValueStore, rank: int, tracked: TrackedState) -> None:
    """Publish the bytes of one version of this rank's own state, for its holders."""
    kv.set(keys.replica_bytes(rank), str(tracked.own.memory()["bytes_per_version"]).encode())


def reserve_replicas(kv: KeyValueStore, replication: Replication, placement: BuddyPlacement, rank: int,
                     timeout: float, background: bool = False, moot: Callable[[], bool] = lambda: False) -> None:
    """Account (and allocate) the replicas of the ranks this rank serves, once they
    published their sizes (``publish_size``). Raises AbortedError as soon as
    ``moot()`` says a new epoch began (a served rank that died before publishing
    never will), TimeoutError after ``timeout``."""
    served = placement.served_by(rank)
    names = [keys.replica_bytes(r) for r in served]
    deadline = time.monotonic() + timeout
    while True:
        try:
            kv.wait(names, timeout=min(0.25, max(deadline - time.monotonic(), 0.001)))
            break
        except TimeoutError:
            if moot():
                raise AbortedError(f"rank {rank}: a new epoch began while it waited for the replica sizes of "
                                   f"ranks {served}") from None
            if time.monotonic() >= deadline:
                raise
    sizes = {r: int(kv.get(keys.replica_bytes(r))) for r in served}
    if background:
        threading.Thread(target=replication.reserve, args=(sizes,), name="peerstate-reserve", daemon=True).start()
    else:
        replication.reserve(sizes)


class StepBoundary:
    """Snapshots each ``snapshot_every``-th step as its version and streams it to
    the buddies one step later. ``capture = False`` skips both (for overhead
    measurements only). The first boundary registers the tracked state (the
    optimizer's state exists only after its first step)."""

    def __init__(self, membership: Membership, tracked: TrackedState, kv: KeyValueStore, placement: BuddyPlacement,
                 checkpoints: DiskCheckpoints, report: RecoveryReport, progress: Optional[ProgressCounter],
                 snapshot_every: int, join_timeout: float) -> None:
        self._membership = membership
        self.tracked = tracked
        self._kv = kv
        self._placement = placement
        self._checkpoints = checkpoints
        self._report = report
        self._progress = progress
        self.snapshot_every = snapshot_every
        self._join_timeout = join_timeout
        self.capture = True
        self.replication: Optional[Replication] = None  # set once this process has a rank
        self._pending_version: Optional[int] = None  # snapshotted, not yet replicated
        self._failing_holders: Dict[int, Optional[str]] = {}  # holder -> why its last push failed
        self._newest_epoch = 0  # the newest epoch the abort path has seen begin (on_new_epoch)
        self._reserve_interrupted = False  # register()'s wait for the replica sizes ended by a new epoch

    @property
    def rank(self) -> Optional[int]:
        return self._membership.rank

    def end_step(self, step: int, seconds: float, epoch: int) -> None:
        report = self._report
        closes_recovery = report.first_step_after == step
        if closes_recovery:
            report.mark("first step")  # the step itself is done; what follows is bookkeeping
        if self._progress:
            self._progress.set_step(step)
        if not self.tracked.registered:
            self.register()
        elif self._reserve_interrupted:
            self._reserve_replicas()  # the first try ended with a new epoch
        if self.capture and step % self.snapshot_every == 0:
            self.start_replication()  # no optimizer hook ran (no optimizer tracked)
            for store in self.tracked.snapshotted(self.rank):
                store.snapshot(step)
            self._pending_version = step
        if self._checkpoints.due(step):
            self._checkpoints.save(step, self.rank)
        report.end_step(step, seconds, epoch, self.rank)
        if closes_recovery:
            release_freed_memory()

    def register(self) -> None:
        """Register the tracked state with the stores, serve it and reserve the replicas
        this rank holds (at the first boundary, or before a resume loads into it)."""
        self.tracked.register(self.rank)
        self.replication_serves_shares()
        publish_size(self._kv, self.rank, self.tracked)
        self._reserve_replicas()

    def _reserve_replicas(self) -> None:
        epoch = self._membership.epoch
        self._reserve_interrupted = True  # until it returns: the next boundary tries again
        reserve_replicas(self._kv, self.replication, self._placement, self.rank, self._join_timeout,
                         moot=lambda: self._newest_epoch > epoch)
        self._reserve_interrupted = False

    def on_new_epoch(self, epoch: int) -> None:
        """The abort path (``AbortHandler``): a wait at the boundary for epoch ``epoch``'s
        predecessors ends now."""
        self._newest_epoch = max(self._newest_epoch, epoch)

    def replication_serves_shares(self) -> None:
        """Serve (and pull into) every data-parallel share store from this rank's one endpoint."""
        for share, store in enumerate(self.tracked.share_stores):
            self.replication.serve_share(share, store)

    def start_replication(self) -> None:
        """Before optimizer.step(): the snapshot of the last version must be complete
        (it reads the live tensors); then stream it to the buddies in the background."""
        version, self._pending_version = self._pending_version, None
        if version is not None:
            for store in self.tracked.snapshotted(self.rank):
                store.wait()
            self._report_failed_round()
            self.replication.replicate(version)  # data-parallel state has no buddies: nothing to send

    def forget_pending(self) -> None:
        """A recovery began: the version snapshotted last is not replicated."""
        self._pending_version = None

    def drain(self) -> None:
        """The loop is done: replicate the last version and wait for its round."""
        self.start_replication()
        in_flight = self.replication.replicator.in_flight_version()
        if in_flight is not None:
            self.replication.wait(in_flight, check=False)

    def _report_failed_round(self) -> None:
        """Say when a push to a holder starts failing: until one lands again, the last
        version that holder committed is this rank's only copy there. The next round
        retries; this only makes the failure visible (event log and stderr)."""
        version = self.replication.replicator.in_flight_version()
        if version is None:
            return
        for holder, error in self.replication.wait(version, check=False).items():
            failing = None if error is None else str(error)
            if failing != self._failing_holders.get(holder):
                self._failing_holders[holder] = failing
                self._report.events.write("replication_failed" if failing else "replication_resumed",
                                          rank=self.rank, holder=holder, version=version, error=failing)
                if failing:
                    print(f"peerstate: rank {self.rank}: version {version} did not reach its holder rank {holder} "
                          f"({failing}); retrying with the next step's version", file=sys.stderr, flush=True)


# What a collective's or a transport's error says when its peer died or its group was
# aborted (gloo raises plain RuntimeErrors; NCCL and the c10d store raise DistErrors).
_PEER_FAILURE_MARKS = ("gloo", "nccl", "c10d", "processgroup", "connection closed by peer", "connection reset",
                       "broken pipe", "timed out waiting", "aborted", "socket")


def raised_by_a_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) may be a peer's failure
    seen from here: a torch.distributed error, a gloo/NCCL error, one of peerstate's.
    Anything else is the script's own (a bug, a bad batch, an out-of-memory): no
    recovery is coming for it unless this rank dies, so waiting for one only holds the
    other ranks in their collectives for ``failure_grace``."""
    import torch.distributed

    from peerstate.errors import Error

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (torch.distributed.DistError, Error)):
            return True
        if isinstance(error, (RuntimeError, OSError)) and any(m in str(error).lower() for m in _PEER_FAILURE_MARKS):
            return True
        error = error.__cause__ or error.__context__
    return False


# Workers of one rank that raised their own error in the same step: then the job stops. Each
# replacement replays the step; a script that fails it every time would take every spare in turn.
SCRIPT_ERROR_REPEATS = 3


def stop_if_raised_again(kv: KeyValueStore, coordinator: "Coordinator", rank: int, step: int,
                         error: BaseException) -> None:
    """Count the script's own error in ``step`` (in the job's store: the replacement
    that replays the step may be on another node) and stop the job at the
    SCRIPT_ERROR_REPEATS-th: a deterministic error, which no spare can fix."""
    repeats = kv.add(keys.script_errors(rank, step), 1)
    if repeats >= SCRIPT_ERROR_REPEATS:
        coordinator.fail_job(f"rank {rank} raised {type(error).__name__}: {str(error)[:300]} in step {step}, and "
                             f"{repeats} of its workers have now raised in that step (each replacement replayed it "
                             "and raised again): the script's own error, which no spare can fix. The job stops "
                             "rather than hand the rank to every spare in turn; the traceback is in the rank's log")


class StepGuard:
    """One step's body (``Job.guard``): on a clean exit the step boundary runs; a
    failure inside, once the coordinator declared it, becomes a recovery. The
    script's own error (``raised_by_a_peer_failure`` says no, and no failure is
    declared yet) is raised at once: its rank exits and its agent hands it to a spare,
    in the time of a kill, where waiting ``failure_grace`` for a plan that only its
    own death would bring held every other rank that long."""

    def __init__(self, joiner: "EpochJoiner", boundary: StepBoundary, membership: Membership,
                 events: EventLog, regroup: "BusyPeerRegroup") -> None:
        self._joiner, self._boundary, self._membership, self._events = joiner, boundary, membership, events
        self._regroup = regroup

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool:
        joiner = self._joiner
        step, epoch = joiner.next_step, self._membership.epoch
        if exc_type is None and joiner.watcher.latest.epoch == epoch:
            try:
                self._boundary.end_step(step, time.monotonic() - self.started, epoch)
                joiner.next_step = step + 1
                return False
            except Exception:  # noqa: BLE001 - a failure during the boundary is a failure too
                if not joiner.failure_declared(epoch):
                    raise
        elif exc_type is not None:
            if not issubclass(exc_type, Exception):
                return False  # KeyboardInterrupt, SystemExit
            if not raised_by_a_peer_failure(exc) and joiner.watcher.latest.epoch == epoch:
                self._events.write("step_raised", step=step, epoch=epoch, rank=self._membership.rank,
                                   error=f"{exc_type.__name__}: {str(exc)[:200]}")
                stop_if_raised_again(joiner.kv, joiner.coordinator, self._membership.rank, step, exc)
                return False
            self._regroup.note(exc, epoch, self._membership.rank)
            if not joiner.failure_declared(epoch) and \
                    not self._regroup.after(exc, joiner.watcher, epoch, self._membership.rank, step):
                return False  # no failure was declared: a genuine error in the loop
        self._events.write("step_interrupted", step=step, epoch=epoch,
                           error=f"{exc_type.__name__}: {str(exc)[:200]}" if exc_type else None)
        self._membership.move(MemberState.RECOVERING)
        return True

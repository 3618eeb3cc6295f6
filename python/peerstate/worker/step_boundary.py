"""The step boundary: what happens at the end of each guarded step (snapshot,
checkpoint, accounting), and before the next ``optimizer.step()`` (the
snapshot must be complete; its replication starts)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional, Union

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.memory_figures import MEMORY_EVENT
from peerstate.control.progress import ProgressCounter
from peerstate.errors import AbortedError, InvalidArgumentError
from peerstate.replication.endpoint import Replication
from peerstate.replication.parity import ParityPlacement, largest_piece
from peerstate.replication.placement import BuddyPlacement
from peerstate.state.training_state import model_parts
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.context import WorkerContext
from peerstate.worker.host_budget import HostMemoryBudget
from peerstate.worker.tracked_state import TrackedState

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


def publish_size(kv: KeyValueStore, rank: int, nbytes: int) -> None:
    """Publish what this rank's holders reserve for it (one request, at a rank's first
    boundary): the bytes of one version of its own state, or, in a parity group, of the
    largest piece it cuts a version into (``parity.largest_piece``)."""
    kv.set(keys.replica_bytes(rank), str(nbytes).encode())


def reserve_replicas(kv: KeyValueStore, replication: Replication, placement: Union[BuddyPlacement, ParityPlacement],
                     rank: int, timeout: float, background: bool = False, moot: Callable[[], bool] = lambda: False,
                     budget: Optional[HostMemoryBudget] = None) -> None:
    """Account (and allocate) the replicas of the ranks this rank serves, once they
    published their sizes (``publish_size``), after ``budget`` (if any) found they
    fit beside its own versions. Raises AbortedError as soon as ``moot()`` says a
    new epoch began (a served rank that died before publishing never will),
    TimeoutError after ``timeout``. In a parity group (``ParityPlacement``), join it
    instead: hold two blocks of the largest piece any member published."""
    if isinstance(placement, ParityPlacement):
        _hold_parity(kv, replication, placement, rank, timeout, background, moot, budget)
        return
    served = placement.served_by(rank)
    names = [keys.replica_bytes(r) for r in served]
    if not kv.wait_until(names, time.monotonic() + timeout, moot):
        raise AbortedError(f"rank {rank}: a new epoch began while it waited for the replica sizes of ranks {served}")
    sizes = {r: int(kv.get(keys.replica_bytes(r))) for r in served}
    if budget is not None:
        budget.replicas(rank, sizes)
    if background:
        threading.Thread(target=replication.reserve, args=(sizes,), name="peerstate-reserve", daemon=True).start()
    else:
        replication.reserve(sizes)


def _hold_parity(kv: KeyValueStore, replication: Replication, placement: ParityPlacement, rank: int,
                 timeout: float, background: bool, moot: Callable[[], bool],
                 budget: Optional[HostMemoryBudget]) -> None:
    group = placement.group_of(rank)
    names = [keys.replica_bytes(r) for r in group]
    if not kv.wait_until(names, time.monotonic() + timeout, moot):
        raise AbortedError(f"rank {rank}: a new epoch began while it waited for the piece sizes of its parity "
                           f"group {group}")
    block = max(int(kv.get(name)) for name in names)
    if budget is not None:
        budget.parity(rank, group, block)
    if background:
        threading.Thread(target=replication.hold_parity, args=(group, block), name="peerstate-reserve",
                         daemon=True).start()
    else:
        replication.hold_parity(group, block)


SYNCED_VERSIONS = 2  # the versions of the synced pipeline (StepBoundary)
EAGER_VERSIONS = 3  # of the eager one; the lazy one needs one more


class StepBoundary:
    """Snapshots each ``snapshot_every``-th step as its version and streams it to
    the buddies. ``capture = False`` skips both (for overhead measurements only).
    The first boundary registers the tracked state (the optimizer's state exists
    only after its first step).

    Three pipelines, chosen by ``versions`` (``JobOptions.versions``):
    - lazy (4 or more, the default): version v is copied during the forward and
      backward of v+1, pushed from the optimizer step of v+1 and waited for at
      that of v+2. Nothing waits on the step's path, but a rank inside step x is
      sure only of x-3 at its holders, so members keep 4 versions.
    - eager (3): v is copied at its boundary (the step waits for the copy),
      pushed at once, and waited for at the optimizer step of v+1 (the step waits
      only for what of the push outlasts a forward and backward). A rank inside
      step x is sure of x-2: one version fewer in every store.
    - synced (2): v is copied beside the forward of v+1 and pushed as soon as
      the copy is done (a thread per version), and its round is waited for when
      the model's forward of v+1 returns (``forward_done``, a forward hook),
      before the backward's collectives. A rank that reaches the boundary of v+1
      finished those, so every rank it exchanged gradients with (all of them,
      through the step's collectives) had v landed everywhere: no rank
      overwrites v-1 before v is a recovery point for the whole job, and 2 slots
      suffice. The step waits for what of the copy and the push outlasts a
      forward."""

    def __init__(self, context: WorkerContext, tracked: TrackedState, checkpoints: DiskCheckpoints,
                 progress: Optional[ProgressCounter], snapshot_every: int, versions: int = 4) -> None:
        self._context = context
        self._membership = context.membership
        self.tracked = tracked
        self._kv = context.kv
        self._placement = context.placement
        self._checkpoints = checkpoints
        self._report = context.report
        self._progress = progress
        self.snapshot_every = snapshot_every
        self.eager = versions <= EAGER_VERSIONS  # eager or synced: the boundary starts the push
        self.synced = versions == SYNCED_VERSIONS
        self._said_no_forward = False
        self._starter: Optional[threading.Thread] = None  # synced: starts the round once the copy is done
        self._starter_error: Optional[BaseException] = None
        self._copying = False  # the last version's copy may still read the live tensors
        self._generation = 0  # forget_pending's count: a starter of an older one pushes nothing
        self._join_timeout = context.join_timeout
        self.capture = True
        self._pending_version: Optional[int] = None  # snapshotted, not yet replicated
        self._failing_holders: Dict[int, Optional[str]] = {}  # holder -> why its last push failed
        self._newest_epoch = 0  # the newest epoch the abort path has seen begin (on_new_epoch)
        self._reserve_interrupted = False  # register()'s wait for the replica sizes ended by a new epoch

    @property
    def rank(self) -> Optional[int]:
        return self._membership.rank

    @property
    def replication(self) -> Replication:
        return self._context.replication

    def end_step(self, step: int, seconds: float, epoch: int) -> None:
        report = self._report
        closes_recovery = report.first_step_after == step
        if closes_recovery:
            report.mark("first step")  # the step itself is done; what follows is bookkeeping
        if self._progress:
            self._progress.set_step(step)
        self.replication.reached(step)
        if not self.tracked.registered:
            self.register()
        elif self._reserve_interrupted:
            self._reserve_replicas()  # the first try ended with a new epoch
        if self.capture and step % self.snapshot_every == 0:
            self.start_replication()  # no optimizer hook ran (no optimizer tracked)
            for store in self.tracked.snapshotted(self.rank):
                store.snapshot(step)
            self._pending_version = step
            self._copying = True
            if self.synced:
                self._start_once_copied()
            elif self.eager:
                self.start_replication()
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
        placement = self._placement
        publish_size(self._kv, self.rank, largest_piece(self.tracked.own, placement.group_size)
                     if isinstance(placement, ParityPlacement) else self.tracked.own.memory()["bytes_per_version"])
        self._reserve_replicas()
        self.report_memory()

    def memory(self) -> Dict[str, int]:
        """``Job.memory``: this rank's stores, and the replicas it holds once it has a rank."""
        replication = self.replication if self._context.ranked else None
        held = [replication.replicas] + ([replication.parity] if replication.parity is not None else []) \
            if replication else []
        return {**self.tracked.memory(self.rank),
                "replicas_held": sum(store.held_bytes() for store in held),
                "replicas_reserved": sum(store.reserved_bytes() for store in held)}

    def report_memory(self) -> None:
        """Write ``memory()`` to the event log, with the rank's share of its node's memory
        (what the run's summary says: ``control.memory_figures``)."""
        budget = self.tracked.budget
        redundancy = "parity" if isinstance(self._placement, ParityPlacement) else "buddies"
        self._report.events.write(MEMORY_EVENT, rank=self.rank, node_share=budget.share if budget else None,
                                  redundancy=redundancy, **self.memory())

    def _reserve_replicas(self) -> None:
        epoch = self._membership.epoch
        self._reserve_interrupted = True  # until it returns: the next boundary tries again
        reserve_replicas(self._kv, self.replication, self._placement, self.rank, self._join_timeout,
                         moot=lambda: self._newest_epoch > epoch, budget=self.tracked.budget)
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
        """Before optimizer.step() (and, eager, at the boundary): the snapshot of the
        last version must be complete (it reads the live tensors); then stream it to
        the buddies in the background. Eager, before optimizer.step(): the version
        pushed at the boundary must have landed."""
        version, self._pending_version = self._pending_version, None
        if version is not None:
            self._wait_copied()
            self._report_failed_round()
            self.replication.replicate(version)  # data-parallel state has no buddies: nothing to send
        elif self.eager:
            if self.synced:
                self._join_starter()
                self._check_forward_waited()
            self._report_failed_round()

    def _start_once_copied(self) -> None:
        """Synced, at the boundary: the copy of the version just snapshotted runs beside
        the next forward; a thread starts its round the moment the copy is done."""
        version, self._pending_version = self._pending_version, None
        stores, generation = list(self.tracked.snapshotted(self.rank)), self._generation
        self._starter = threading.Thread(target=self._copy_then_push, args=(version, stores, generation),
                                         name="peerstate-push-start", daemon=True)
        self._starter.start()

    def _copy_then_push(self, version: int, stores: list, generation: int) -> None:
        try:
            for store in stores:
                store.wait()
            if generation == self._generation:
                self.replication.replicate(version)
        except BaseException as error:  # raised on the training thread, by _join_starter
            self._starter_error = error

    def _join_starter(self) -> None:
        """Wait until the round of the last version started (its copy done); raise what
        stopped it, on the training thread."""
        starter, self._starter = self._starter, None
        if starter is not None:
            starter.join()
            error, self._starter_error = self._starter_error, None
            if error is not None:
                raise error

    def wait_in_forwards(self, model: Any) -> None:
        """The synced pipeline: make each module of ``model`` (``track(model=...)``: one,
        or a list of parts) call ``forward_done`` when its forward returns. Raises
        InvalidArgumentError, before anything is registered, when it has none."""
        if not self.synced:
            return
        modules = [m for m in model_parts(model) if hasattr(m, "register_forward_hook")]
        if not modules:
            raise InvalidArgumentError("Job(versions=2) waits for each version's push when the model's forward "
                                       "returns: track(model=...) the nn.Module(s) each step runs, or keep 3 versions")
        for module in modules:
            module.register_forward_hook(lambda *_: self.forward_done())

    def wait_copied_in_norms(self, model: Any) -> None:
        """Lazy and synced pipelines: the last version's copy runs beside the next forward,
        and a normalisation layer in training updates its running statistics in place
        there (BatchNorm, InstanceNorm with ``track_running_stats``): the copy could
        catch them part-way, and the version would not be the state of its step. Each
        such module of ``model`` waits for the copy before its forward (a pre-hook); a
        model without one keeps the whole overlap. A module of the script's own that
        updates a tracked tensor in its forward is not seen: keep 3 versions for it."""
        if self.eager and not self.synced:
            return  # eager: copied at the boundary
        for part in model_parts(model):
            for module in part.modules() if hasattr(part, "modules") else ():
                if getattr(module, "track_running_stats", False) and getattr(module, "running_mean", None) is not None:
                    module.register_forward_pre_hook(lambda module, _: self._wait_copied() if module.training else None)

    def _wait_copied(self) -> None:
        """Wait for the copy of the last version snapshotted (raise its error)."""
        if self._copying:
            self._copying = False
            for store in self.tracked.snapshotted(self.rank):
                store.wait()

    def forward_done(self) -> None:
        """The synced pipeline's wait (a forward hook on each tracked module): the
        round of the version pushed at the last boundary must have landed before this
        step's backward. Later forwards of the step (microbatches) find it done."""
        if self.synced and self._context.ranked:
            self._join_starter()
            self._report_failed_round()

    def _check_forward_waited(self) -> None:
        """Say once if an optimizer step finds the last push's round still in flight: no
        forward of a tracked module waited for it (the script runs another module's
        forward), so the wait falls to the optimizer step, after the backward's
        collectives, and 2 versions no longer guarantee a step every rank holds; a
        recovery may fall back to the disk checkpoint."""
        version = self.replication.replicator.in_flight_version()  # None once a wait joined the round
        if version is None or self._said_no_forward:
            return
        self._said_no_forward = True
        message = (f"rank {self.rank}: Job(versions=2) waits for each version's push when the tracked model's "
                   f"forward returns, and no forward of it ran before the optimizer step after version {version}: "
                   "track(model=...) the module(s) the step calls, or keep 3 versions")
        self._report.events.write("forward_not_tracked", rank=self.rank, version=version, message=message)
        print(f"peerstate: {message}", file=sys.stderr, flush=True)

    def forget_pending(self) -> None:
        """A recovery began: the version snapshotted last is not replicated (call it
        before the replication is reset: a synced round about to start is stopped, or
        has started in the epoch the abort ended)."""
        self._pending_version = None
        self._copying = False  # the restore cancels it
        self._generation += 1
        starter, self._starter = self._starter, None
        if starter is not None:
            starter.join()
            self._starter_error = None

    def drain(self) -> None:
        """The loop is done: replicate the last version and wait for its round."""
        if self.synced:
            self._join_starter()  # no forward follows the last boundary: nothing to say
        else:
            self.start_replication()
        in_flight = self.replication.replicator.in_flight_version()
        if in_flight is not None:
            self.replication.wait(in_flight, check=False)

    def _report_failed_round(self) -> None:
        """Wait for the round in flight and say when a push to a holder starts failing:
        until one lands again, the last version that holder committed is this rank's
        only copy there. The next round retries; this only makes the failure visible
        (event log and stderr)."""
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

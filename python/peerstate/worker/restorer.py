"""The restorer: carries out a member's ``RestorePlan`` (see
``control.planning.plan_restore``), from its own snapshot, its peers' copies or
a disk checkpoint."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Optional

from peerstate.control.messages import RestorePlan, RestoreSource, SharePull
from peerstate.errors import InternalError
from peerstate.replication.endpoint import Replication
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.context import WorkerContext
from peerstate.worker.tracked_state import TrackedState


class Background(threading.Thread):
    """Runs ``fn(*args)`` on a thread; ``join()`` re-raises what it raised."""

    def __init__(self, fn: Callable[..., None], *args: Any, name: str = "peerstate-roll-back") -> None:
        super().__init__(name=name, daemon=True)
        self._fn, self._args = fn, args
        self._error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            self._fn(*self._args)
        except BaseException as error:  # noqa: BLE001 - handed to join()
            self._error = error

    def join(self, timeout: Optional[float] = None, check: bool = True) -> None:  # type: ignore[override]
        super().join(timeout)
        if check and self._error is not None:
            raise self._error


class Restorer:
    """Brings the tracked state to a plan's version. A plan for a member without
    state whose state is not registered yet (a replacement before ``track()``) is
    kept as ``pending`` and carried out by ``restore_pending``."""

    def __init__(self, context: WorkerContext, tracked: TrackedState, checkpoints: DiskCheckpoints) -> None:
        self._context = context
        self._membership = context.membership
        self._tracked = tracked
        self._checkpoints = checkpoints
        self._report = context.report
        self.pending: Optional[RestorePlan] = None

    @property
    def replication(self) -> Replication:
        return self._context.replication

    def can_run(self, needs_state: bool) -> bool:
        """Whether a plan can be carried out now (else it waits for ``track()``)."""
        return self._tracked.registered or not needs_state

    def run(self, plan: RestorePlan) -> None:
        """Carry out ``plan`` now: a member that needs state pulls (or loads) it all; one
        that kept it rolls back from its own snapshot and pulls the shares it lacks."""
        if self._membership.needs_state:
            self.pending = plan
            self.restore_pending()
        elif plan.source is RestoreSource.CHECKPOINT:
            self._checkpoints.load(plan.checkpoint, plan.version, self._membership.rank)
            self._report.mark("restore")
        elif plan.source is RestoreSource.LOCAL:
            # The replacements of its parity group wait for the pieces it rebuilds: those first.
            rebuilds = [Background(self.replication.rebuild_piece, lost, plan.version, name="peerstate-rebuild")
                        for lost in plan.rebuild]
            self._pull_shares(plan.version, plan.shares, replacement=False)
            self._tracked.restore(plan.version, pulled_shares=set(plan.shares))
            for rebuild in rebuilds:
                rebuild.join()
            self._report.mark("restore")
        else:
            raise InternalError(f"peerstate bug: a member that kept its state was planned a {plan.source.value} "
                                "restore")

    def restore_pending(self) -> None:
        """Carry out the plan kept for a member without state."""
        plan, rank = self.pending, self._membership.rank
        if plan.source is RestoreSource.CHECKPOINT:
            self._checkpoints.load(plan.checkpoint, plan.version, rank)
            self._report.mark("transfer")
        else:
            if plan.parity:  # from the pieces the other members of its group rebuild meanwhile
                self.replication.pull_pieces(rank, plan.version, plan.own_sources, wait=self._context.join_timeout)
            else:
                self.replication.pull(rank, plan.version, sources=plan.own_sources)
            self._pull_shares(plan.version, plan.shares, replacement=True)
            self._report.mark("transfer")
            self._tracked.restore(plan.version, pulled_shares=plan.shares, pulled_own=True)
        self._report.mark("restore")
        self.pending = None
        self._membership.restored()
        self._tracked.remember_rng()  # a replacement's script runs on from track(): Job.guard checks it kept them

    def _pull_shares(self, version: int, pulls: Mapping[int, SharePull], replacement: bool) -> None:
        """Pull ``version`` of the data-parallel shares in ``pulls``, all at once, so that
        a share read from a node-mate's memory overlaps one coming over the network.
        (On the 2 busy cores of the benches this measured no faster than one after
        the other: nothing was idle to overlap.)"""
        shares = sorted(pulls)
        results = {}

        def run(share: int) -> None:
            results[share] = self.replication.pull_share(share, version, pulls[share].sources,
                                                         pulls[share].same_node)

        threads = [Background(run, share, name=f"peerstate-pull-share-{share}") for share in shares]
        for thread in threads:
            thread.join(check=False)
        for thread in threads:
            thread.join()  # the first error, once none is left running
        if shares:  # logged after the first step
            self._report.pulled = dict(
                rank=self._membership.rank, version=version, replacement=replacement, shares=shares,
                sources={share: pulls[share].sources for share in shares},
                same_node_sources=sorted({s for share in shares for s in pulls[share].same_node}),
                chunks=sum(results[s].chunks for s in shares),
                chunks_from_memory=sum(results[s].chunks_from_memory for s in shares))

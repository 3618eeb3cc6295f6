"""Joining an epoch: report what this member holds, agree on the recovery point,
re-form the process groups, and restore (see ``EpochJoiner.join``)."""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, Optional

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import TorchKeyValueStore
from peerstate.control.messages import MemberReport, RecoveryPlan, RestorePlan, RestoreSource
from peerstate.control.planning import plan_restore
from peerstate.control.timeline import EventLog
from peerstate.errors import AbortedError, JobFailedError, StateLostError
from peerstate.replication.endpoint import Replication
from peerstate.replication.placement import BuddyPlacement, DataParallelShares
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.membership import EpochWatcher, Membership
from peerstate.worker.process_groups import ProcessGroups
from peerstate.worker.rebuild import DistributedWrappers
from peerstate.worker.report import RecoveryReport
from peerstate.worker.restorer import Background, Restorer
from peerstate.worker.step_boundary import StepBoundary, reserve_replicas
from peerstate.worker.tracked_state import TrackedState


class Superseded(Exception):
    """A newer epoch began while this one was being joined."""


class EpochJoiner:
    """Runs the joins of one member. Every collaborator is handed in; the
    replication endpoint and the watcher are set once the member has a rank."""

    def __init__(self, membership: Membership, kv: TorchKeyValueStore, coordinator: Coordinator,
                 groups: ProcessGroups, tracked: TrackedState, restorer: Restorer, boundary: StepBoundary,
                 wrappers: DistributedWrappers, checkpoints: DiskCheckpoints, report: RecoveryReport,
                 events: EventLog, placement: BuddyPlacement, shares: DataParallelShares, world_size: int,
                 join_timeout: float, failure_grace: float) -> None:
        self.membership = membership
        self.kv = kv
        self.coordinator = coordinator
        self.groups = groups
        self.tracked = tracked
        self.restorer = restorer
        self.boundary = boundary
        self.wrappers = wrappers
        self.checkpoints = checkpoints
        self.report = report
        self.events = events
        self.placement = placement
        self.shares = shares
        self.world_size = world_size
        self.join_timeout = join_timeout
        self.failure_grace = failure_grace
        self.replication: Optional[Replication] = None
        self.watcher: Optional[EpochWatcher] = None
        self.next_step = 0
        self.recoveries = 0

    def recover(self) -> None:
        """Join the newest epoch, and again while newer ones supersede it."""
        while True:
            try:
                self.join(self.watcher.latest)
                return
            except Superseded:
                continue

    def join(self, plan: RecoveryPlan) -> None:
        """Join ``plan``'s epoch: report, agree on the recovery point, re-form, restore.
        Raises Superseded when a newer epoch began meanwhile."""
        membership, rank = self.membership, self.membership.rank
        if plan.members.get(rank) != membership.worker:
            raise JobFailedError(f"rank {rank} was given to {plan.members.get(rank)} in epoch "
                                 f"{plan.epoch}: this worker was declared failed")
        needs_state = membership.begin_join()
        if plan.epoch > 0:
            self.wrappers.release(plan.epoch, publish=not needs_state)
            self.groups.destroy()
            with membership.lock:  # see AbortHandler
                self.replication.reset()
                membership.epoch = plan.epoch
            self.boundary.forget_pending()
            if not needs_state:
                self.report.mark("abort")
        membership.epoch = plan.epoch
        reports = self._exchange_reports(plan.epoch, needs_state)
        restore = None
        if plan.epoch > 0:
            restore = self._plan(plan, reports, needs_state)
            self.next_step = restore.version + 1
            self.report.first_step_after = self.next_step
        # Rolling back from memory overlaps the re-forming of the group: both take tens
        # of milliseconds, and neither needs the other.
        rolling = None
        if restore is not None and restore.source is not RestoreSource.CHECKPOINT and \
                self.restorer.can_run(needs_state):
            rolling = Background(self.restorer.run, restore)
        try:
            self.groups.form(self.kv.torch_store, plan.epoch, rank, self.world_size, self.join_timeout)
            self.check_current(plan.epoch)
        except (AbortedError, Superseded):
            if rolling is not None:
                rolling.join(check=False)
            raise Superseded() from None
        self.report.mark("re-form")
        self.events.write("joined", epoch=plan.epoch, rank=rank)
        if plan.epoch == 0:
            membership.end_join()
            return
        self.recoveries += 1
        if rolling is not None:
            try:
                rolling.join()
            except Exception:  # noqa: BLE001 - a pull from a member that died meanwhile
                if not self.failure_declared(plan.epoch):
                    raise
                raise Superseded() from None
        elif self.restorer.can_run(needs_state):
            self.restorer.run(restore)
        else:
            self.restorer.pending = restore  # track() restores once the state is registered
        membership.end_join()
        if needs_state:
            # Off the critical path: the first push to this holder comes a step later
            # (if it came sooner, it would fail and the next round would carry it).
            reserve_replicas(self.kv, self.replication, self.placement, rank, self.join_timeout, background=True)
            return
        self.wrappers.rebuild()

    def _exchange_reports(self, epoch: int, needs_state: bool) -> Dict[int, MemberReport]:
        """Publish this member's report, read every member's, and point the transport
        at every member's server."""
        rank = self.membership.rank
        local = self.tracked.local_versions(rank)
        share = self.tracked.own_share(rank)
        regions = {v: share.region_address(v) for v in local} if share is not None else {}
        self.kv.set(keys.member_report(epoch, rank), MemberReport(
            rank, self.membership.worker, local, self.replication.held_versions(), self.replication.address,
            needs_state, os.getpid(), regions).encode())
        reports = self._gather_reports(epoch)
        self.replication.connect({r: report.address for r, report in reports.items()})
        return reports

    def _plan(self, plan: RecoveryPlan, reports: Dict[int, MemberReport], needs_state: bool) -> RestorePlan:
        """This member's restore plan; a loss falls back to the disk checkpoint or stops the job."""
        rank = self.membership.rank
        restore = plan_restore(rank, self.membership.worker, needs_state, reports, self.placement,
                               self.shares if self.tracked.data_parallel else None, plan.failed,
                               self.checkpoints.latest())
        if restore.source is RestoreSource.LOST:
            reason = f"{restore.message}. No disk checkpoint is configured (--checkpoint-dir), so the job stops."
            self.coordinator.fail_job(reason)
            held = {r: {"local": report.local, "replicas": report.replicas, "needs_state": report.needs_state}
                    for r, report in reports.items()}
            self.events.write("state_lost", epoch=plan.epoch, message=reason, held=held)
            raise StateLostError(reason)
        if restore.source is RestoreSource.CHECKPOINT:
            self.events.write("checkpoint_fallback", epoch=plan.epoch, message=restore.message, step=restore.version,
                              path=restore.checkpoint)
            print(f"peerstate: {restore.message}; falling back to the disk checkpoint of step {restore.version} "
                  f"({restore.checkpoint})", file=sys.stderr, flush=True)
        else:
            self.replication.drop_newer(restore.version)
        return restore

    def _gather_reports(self, epoch: int) -> Dict[int, MemberReport]:
        names = [keys.member_report(epoch, r) for r in range(self.world_size)]
        deadline = time.monotonic() + self.join_timeout
        while True:
            self.check_current(epoch)
            try:
                self.kv.wait(names, timeout=0.5)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    missing = [r for r, raw in zip(range(self.world_size), self.kv.get_many(names)) if raw is None]
                    raise JobFailedError(f"ranks {missing} did not join epoch {epoch} within "
                                         f"{self.join_timeout:.0f}s") from None
        return {r: MemberReport.decode(raw) for r, raw in enumerate(self.kv.get_many(names))}

    def failure_declared(self, epoch: int) -> bool:
        """After an error in the loop: wait for the coordinator to declare a failure
        (a plan for a newer epoch). Up to ``failure_grace`` seconds, and for as long
        as a plan is being written (its writer may be waiting for a spare)."""
        if self.watcher.wait_newer(epoch, self.failure_grace):
            return True
        deadline = time.monotonic() + self.join_timeout
        while self.kv.get(keys.epoch_owner(epoch + 1)) is not None and time.monotonic() < deadline:
            if self.watcher.wait_newer(epoch, 1.0):
                return True
            if self.coordinator.failure():
                return False
        return False

    def check_current(self, epoch: int) -> None:
        if self.watcher.latest.epoch > epoch:
            raise Superseded()
        failure = self.coordinator.failure()
        if failure:
            raise JobFailedError(f"the job stopped: {failure}")

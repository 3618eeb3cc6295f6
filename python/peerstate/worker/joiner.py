"""Joining an epoch: report what this member holds, agree on the recovery point,
re-form the process groups, and restore (see ``EpochJoiner.join``)."""

from __future__ import annotations

import os
import sys
import time
from typing import List, Tuple

from peerstate.control import keys
from peerstate.control.messages import (MemberInstructions, MemberReport, NodeInstructions, RecoveryPlan, RestorePlan,
                                        RestoreSource)
from peerstate.control.planning import expand, lost_without_checkpoint, node_of_worker
from peerstate.errors import AbortedError, Error, JobFailedError, StateLostError
from peerstate.errors import TimeoutError as PeerstateTimeoutError
from peerstate.replication.endpoint import Replication
from peerstate.replication.stopped_holder import StoppedHolder
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.context import WorkerContext
from peerstate.worker.membership import EpochWatcher, job_failure
from peerstate.worker.peer_failure import raised_by_a_peer_failure
from peerstate.worker.process_groups import ProcessGroups
from peerstate.worker.rebuild import DistributedWrappers
from peerstate.worker.regroup import BusyPeerRegroup
from peerstate.worker.restorer import Background, Restorer
from peerstate.worker.step_boundary import StepBoundary, reserve_replicas
from peerstate.worker.tracked_state import TrackedState


# A gloo formation that completes no group for this long is given up (Job: the smaller of
# it and abort_timeout / 10). The members reach the formation together, after the join's
# barrier, and forming takes milliseconds; a member that dies in it is ended sooner, by the
# abort of the epoch that replaces it (see process_groups).
FORM_CONNECT_TIMEOUT = 2.0
# A recovery's formation is given up after this instead: a member killed in the middle of
# it (a second kill during a recovery) held the others with no step until its epoch's
# abort, while a formation takes ~0.1 s at the median and ~0.3 s at most on a loaded 2-core
# machine (the members' arrival included). It doubles after each formation timeout that no
# loss explains (a slower machine), up to FORM_CONNECT_TIMEOUT. At epoch 0 a timeout stops
# the job, so that formation takes the whole FORM_CONNECT_TIMEOUT.
RECOVERY_CONNECT_TIMEOUT = 0.5
# After a formation timed out, how long a member waits for a newer epoch before it asks
# for a regroup: a killed member's failure is declared in milliseconds. (A frozen one's
# after --hang-timeout: the regroup's epoch then waits for its report, and the failure's
# epoch comes next.)
FORMATION_GRACE = 1.0
# Formation timeouts in a row that no lost member explains: then the timeout is raised
# (the rank exits), rather than regrouping for ever.
MAX_FORMATION_REGROUPS = 3
# How often a member waiting for its instructions looks for a newer epoch (a wait on the
# node channel, its agent's: no load on the job's store). Slower, a survivor notices a
# superseding epoch late by up to this much, which at 0.5 s was a third of a recovery.
INSTRUCTIONS_POLL = 0.05


class Superseded(Exception):
    """A newer epoch began while this one was being joined."""


class EpochJoiner:
    """Runs the joins of one member, from its ``WorkerContext`` (the replication
    endpoint and the watcher are the context's, set once the member has a rank)
    and the parts a join drives."""

    def __init__(self, context: WorkerContext, groups: ProcessGroups, tracked: TrackedState, restorer: Restorer,
                 boundary: StepBoundary, wrappers: DistributedWrappers, checkpoints: DiskCheckpoints,
                 regroup: BusyPeerRegroup) -> None:
        self.context = context
        self.groups = groups
        self.tracked = tracked
        self.restorer = restorer
        self.boundary = boundary
        self.wrappers = wrappers
        self.checkpoints = checkpoints
        self.regroup = regroup  # asks for a regroup when a formation times out with nobody lost
        ceiling = groups.connect_timeout
        self.recovery_connect_timeout = min(ceiling, RECOVERY_CONNECT_TIMEOUT) if ceiling else None
        self.recoveries = 0
        self._formation_timeouts = 0  # in a row, that no lost member explained

    @property
    def replication(self) -> Replication:
        return self.context.replication

    @property
    def watcher(self) -> EpochWatcher:
        return self.context.watcher

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
        membership, rank = self.context.membership, self.context.membership.rank
        if plan.replaced.get(rank, membership.worker) != membership.worker:
            raise JobFailedError(f"rank {rank} was given to {plan.replaced[rank]} in epoch "
                                 f"{plan.epoch}: this worker was declared failed")
        needs_state = membership.begin_join()
        if plan.epoch > 0:
            self.context.report.recovery_began()
            self.wrappers.release()
            self.groups.destroy()
            self.boundary.forget_pending()  # before the reset: no round of the old epoch starts in the new
            with membership.lock:  # see AbortHandler
                self.replication.reset()
                membership.epoch = plan.epoch
            if not needs_state:
                self.context.report.mark("abort")
        membership.epoch = plan.epoch
        stopped, share = self._adopt_stopped(rank) if needs_state and plan.epoch > 0 else ([], [])
        orders, kept_state = self._report_and_wait(plan.epoch, needs_state, stopped, share)
        restore = None
        if plan.epoch > 0:
            if not needs_state:  # for the replacements, once per node (they read it after their restore)
                self.wrappers.publish_layouts(plan.epoch, rank, kept_state)
            restore = self._plan(plan, orders.restore)
            # Steps completed after the recovery point run again; the first is the recovery's own.
            self.context.report.replayed_steps += membership.rolled_back_to(restore.version)
            self.context.report.first_step_after = membership.next_step
        # Rolling back from memory overlaps the re-forming of the group: both take tens
        # of milliseconds, and neither needs the other.
        rolling = None
        if restore is not None and restore.source is not RestoreSource.CHECKPOINT and \
                self.restorer.can_run(needs_state):
            rolling = Background(self.restorer.run, restore)
        self.groups.collective_timeout = plan.collective_timeout or self.groups.default_collective_timeout
        try:
            self._form(plan.epoch, rank)
        except Superseded:
            if rolling is not None:
                rolling.join(check=False)
            raise
        self.context.report.mark("re-form")
        self.context.events.write("joined", epoch=plan.epoch, rank=rank)
        if plan.epoch == 0:
            membership.end_join()
            return
        self.recoveries += 1
        if rolling is not None:
            try:
                rolling.join()
            except Exception as error:  # noqa: BLE001 - a pull from a member that died meanwhile?
                # The script's own load_state_dict raising is no peer's failure: waiting
                # failure_grace for a plan would only hold the others that long.
                if not raised_by_a_peer_failure(error) or not self.failure_declared(plan.epoch):
                    raise
                raise Superseded() from None
        elif self.restorer.can_run(needs_state):
            self.restorer.run(restore)
        else:
            self.restorer.pending = restore  # track() restores once the state is registered
        membership.end_join()
        if needs_state:
            if self.restorer.pending is None:  # pulled: else it is killed at its hold's end
                self.replication.release_once_replicated(self._release_stopped)
            # Off the critical path: the first push to this holder comes a step later
            # (if it came sooner, it would fail and the next round would carry it).
            context = self.context
            reserve_replicas(context.kv, self.replication, context.placement, rank, context.join_timeout,
                             background=True, budget=self.tracked.budget)
            return
        self.wrappers.rebuild()

    def _form(self, epoch: int, rank: int) -> None:
        """Re-form the process groups. Superseded when a newer epoch began meanwhile.
        After a formation timeout, this member does not exit (that would cost the job
        a spare): it joins the epoch that declares a member lost in the rendezvous, or,
        when none comes within ``FORMATION_GRACE`` (a member was late, not lost), asks
        for a regroup, in which the same members form the group again. After
        ``MAX_FORMATION_REGROUPS`` such timeouts in a row, or in epoch 0, the timeout
        is raised."""
        connect = self.recovery_connect_timeout if epoch > 0 else None
        try:
            self.groups.form(self.context.kv, epoch, rank, self.context.world_size, self.context.join_timeout,
                             connect_timeout=connect, channel=self.context.channel)
        except AbortedError:
            raise Superseded() from None
        except PeerstateTimeoutError as error:
            if self.watcher.wait_newer(epoch, FORMATION_GRACE):
                raise Superseded() from None
            self._formation_timeouts += 1
            if epoch == 0 or self._formation_timeouts > MAX_FORMATION_REGROUPS:
                raise  # at the job's start there is no step to regroup at: it fails, saying why
            if connect:  # a late member, not a lost one: this machine forms slower than that
                self.recovery_connect_timeout = min(2 * connect, self.groups.connect_timeout)
            self._regroup_after(error, epoch, rank)
            if self.watcher.wait_newer(epoch, self.context.join_timeout):
                raise Superseded() from None
            raise
        self._formation_timeouts = 0
        self.check_current(epoch)

    def _regroup_after(self, error: BaseException, epoch: int, rank: int) -> None:
        reason = (f"rank {rank}: {error}, and no member was declared lost (one was late): the same members form "
                  f"it again in epoch {epoch + 1}")
        self.regroup.begin(epoch, rank, reason, self.watcher.latest.collective_timeout, cause="formation timeout")

    def _adopt_stopped(self, rank: int) -> Tuple[List[int], List[int]]:
        """A replacement whose predecessor hung (its agent froze it and named it in the node
        channel) takes over what it held: its replicas and its data-parallel share now,
        its own state as one more source of the pull. Returns the versions of its own
        state held there and of the share adopted. Anything unreadable is said and left
        out: the recovery then plans without it."""
        holder = self.replication.stopped_holder
        if holder is not None:  # adopted in an earlier epoch's join, superseded since
            return sorted(holder.own), self.replication.adopted_share
        raw = self.context.channel.get(keys.stopped_holder(rank))
        if not raw:
            return [], []
        pid, address = (int(x) for x in raw.decode().split(":"))
        try:
            holder = StoppedHolder(pid, address)
        except Error as error:
            self.context.events.write("stopped_holder_unreadable", rank=rank, pid=pid, error=str(error))
            print(f"peerstate: rank {rank}: the memory of its hung predecessor (pid {pid}) cannot be read, so it "
                  f"is not a source: {error}", file=sys.stderr, flush=True)
            self.context.channel.set(keys.stopped_holder_released(pid), b"1")
            return [], []
        shares = self.tracked.shares if self.tracked.own_share(rank) is not None else None
        replicas, adopted_share, refused = self.replication.adopt(
            holder, shares.local(shares.share_of(rank)) if shares is not None else None)
        self.context.events.write("stopped_holder_adopted", rank=rank, pid=pid, own=sorted(holder.own),
                                  replicas={str(s): v for s, v in replicas.items()}, share=adopted_share,
                                  refused=refused)
        for why in refused:
            print(f"peerstate: rank {rank}: what its hung predecessor held was not all adopted: {why}",
                  file=sys.stderr, flush=True)
        return sorted(holder.own), adopted_share

    def _release_stopped(self) -> None:
        """Tell the agent this member no longer reads its stopped predecessor (it is killed)."""
        holder = self.replication.stopped_holder
        if holder is not None:
            self.replication.release_stopped()
            self.context.channel.set(keys.stopped_holder_released(holder.pid), b"1")

    def _report_and_wait(self, epoch: int, needs_state: bool, stopped: List[int],
                         adopted_share: List[int]) -> Tuple[MemberInstructions, List[int]]:
        """Hand this member's report to its agent (the node channel) and wait for its
        instructions; point the transport at the peers they name. Returns them, and the
        ranks of this node's members that kept their state."""
        rank = self.context.membership.rank
        local = self.tracked.local_versions(rank)
        share = self.tracked.own_share(rank)
        regions = {v: share.region_address(v) for v in {*local, *adopted_share}} if share is not None else {}
        self.context.channel.set(keys.member_report(epoch, rank), MemberReport(
            rank, self.context.membership.worker, local, self.replication.held_versions(), self.replication.address,
            needs_state, os.getpid(), regions, self.checkpoints.latest(), self.tracked.layout, stopped,
            adopted_share, self.replication.parity_versions()).encode())
        key = keys.member_instructions(epoch, node_of_worker(self.context.membership.worker))
        self.check_current(epoch)
        try:  # check_current raises once the wait is moot
            self.context.channel.wait_until([key], time.monotonic() + self.context.join_timeout,
                                            lambda: self.check_current(epoch) or False, poll=INSTRUCTIONS_POLL)
        except TimeoutError:
            raise JobFailedError(f"rank {rank} got no instructions for epoch {epoch} within "
                                 f"{self.context.join_timeout:.0f}s: the members of some node did not all join "
                                 "(see the agents' output)") from None
        node_orders = NodeInstructions.decode(self.context.channel.get_existing([key])[0])
        names = [keys.member_report(epoch, r) for r in node_orders.members]
        raws = self.context.channel.get_existing(names)
        reports = {r: MemberReport.decode(raw) for r, raw in zip(node_orders.members, raws)}
        orders = expand(node_orders, reports, [rank])[rank]
        self.replication.connect(orders.addresses)
        return orders, [r for r, report in reports.items() if not report.needs_state]

    def _plan(self, plan: RecoveryPlan, restore: RestorePlan) -> RestorePlan:
        """Act on this member's restore plan: a loss (the plan writer already stopped
        the job) raises; a checkpoint fallback is said; the replicas newer than the
        recovery point go, whichever it is. (Kept after a fallback, they refused every
        re-run version up to their own: the job ran unreplicated back to where it was.)"""
        if restore.source is RestoreSource.LOST:
            reason = lost_without_checkpoint(restore.message)
            self.context.coordinator.fail_job(reason)
            raise StateLostError(reason)
        if restore.source is RestoreSource.CHECKPOINT:
            print(f"peerstate: {restore.message}; falling back to the disk checkpoint of step {restore.version} "
                  f"({restore.checkpoint})", file=sys.stderr, flush=True)
        self.replication.drop_newer(restore.version)
        return restore

    def failure_declared(self, epoch: int) -> bool:
        """After an error in the loop: wait for the coordinator to declare a failure
        (a plan for a newer epoch). Up to ``failure_grace`` seconds, and for as long
        as a plan is being written (its writer may be waiting for a spare)."""
        if self.watcher.wait_newer(epoch, self.context.failure_grace):
            return True
        # Past the grace only: a plan being written (a request a second to the job's store).
        deadline = time.monotonic() + self.context.join_timeout
        while self.context.kv.get(keys.epoch_owner(epoch + 1)) is not None and time.monotonic() < deadline:
            if self.watcher.wait_newer(epoch, 1.0):
                return True
            if job_failure(self.context.channel):
                return False
        return False

    def check_current(self, epoch: int) -> None:
        """Superseded once a newer epoch began; JobFailedError once the job stopped. Both
        read what the agent copied into the node channel: a member calls it every
        ``INSTRUCTIONS_POLL`` while it waits, which on the job's store was the herd
        of a recovery (20 requests a second a rank)."""
        if self.watcher.latest.epoch > epoch:
            raise Superseded()
        failure = job_failure(self.context.channel)
        if failure:
            raise JobFailedError(f"the job stopped: {failure}")

"""One worker's parts, built in the order their dependencies need and handed to each
other as they are built (``assemble``); ``WorkerParts`` holds them for ``Job`` and
runs the steps of their life that involve most of them: tracking the state, taking
a rank, recovering between steps, finishing, and closing in order. ``Job`` is the
script's documented face of them.

Who talks to whom: the node channel (to the agent) carries reports, instructions and
the job's failure; the job's store only the process groups' rendezvous and the few
requests docs/recovery.md lists. ``WorkerContext`` is what the parts share."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar, Union

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.environment import WorkerEnvironment
from peerstate.control.findings import OVERRIDDEN, report_finding
from peerstate.control.kvstore import KeyValueStore, TorchKeyValueStore
from peerstate.control.messages import RecoveryPlan
from peerstate.control.progress import ProgressCounter
from peerstate.control.stores import open_store
from peerstate.control.timeline import EventLog
from peerstate.errors import InvalidArgumentError
from peerstate.state.training_state import optimizer_parts
from peerstate.replication.endpoint import Replication
from peerstate.replication.parity import ParityPlacement
from peerstate.replication.placement import BuddyPlacement
from peerstate.replication.stopped_holder import permit_reads_by_the_node
from peerstate.worker.abort import AbortHandler
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.context import WorkerContext
from peerstate.worker.host_budget import HostMemoryBudget, node_memory
from peerstate.worker.joiner import FORM_CONNECT_TIMEOUT, EpochJoiner, Superseded
from peerstate.worker.membership import EpochWatcher, Membership, MemberState, wait_for_assignment
from peerstate.worker.meshes import BuiltMeshes, DeclaredMesh, replica_dimension
from peerstate.worker.options import JobOptions
from peerstate.worker.process_groups import ProcessGroups, Subgroup, claim_default_group, release_default_group
from peerstate.worker.rebuild import DistributedWrappers
from peerstate.worker.regroup import BusyPeerRegroup
from peerstate.worker.report import RecoveryReport
from peerstate.worker.restorer import Restorer
from peerstate.worker.resume import CheckpointResume
from peerstate.worker.script_timeouts import claim_pg_timeouts, release_pg_timeouts
from peerstate.worker.step_boundary import StepBoundary
from peerstate.worker.step_guard import StepChecks, StepGuard, counting_recovery_errors
from peerstate.worker.torch_private import untested_torch
from peerstate.worker.tracked_state import TrackedState
from peerstate.worker.unguarded import UnguardedCollectives

Declared = TypeVar("Declared", Subgroup, DeclaredMesh, BuiltMeshes)


@dataclass
class WorkerParts:
    """Every part of one worker (see each part's module for its contract)."""

    options: JobOptions
    env: WorkerEnvironment
    backend: str
    events: EventLog
    kv: KeyValueStore
    channel: KeyValueStore
    coordinator: Coordinator
    placement: BuddyPlacement
    progress: Optional[ProgressCounter]
    groups: ProcessGroups
    membership: Membership
    tracked: TrackedState
    wrappers: DistributedWrappers
    checkpoints: DiskCheckpoints
    report: RecoveryReport
    context: WorkerContext
    boundary: StepBoundary
    resume: CheckpointResume
    restorer: Restorer
    regroup: BusyPeerRegroup
    joiner: EpochJoiner
    aborts: AbortHandler
    checks: StepChecks
    meshes: List[Union[DeclaredMesh, BuiltMeshes]] = field(default_factory=list)

    def plan(self, epoch: int) -> RecoveryPlan:
        """Epoch ``epoch``'s plan, from the agent's copy in the node channel."""
        key = keys.epoch_plan(epoch)
        self.channel.wait([key], timeout=self.options.join_timeout)
        return RecoveryPlan.decode(self.channel.get(key))

    def take_rank(self, plan: RecoveryPlan, rank: int, certificate: Optional[bytes] = None) -> None:
        """Take ``rank`` in ``plan``'s epoch (or a newer one) and join it (a spare: with
        the ``certificate`` of that rank its agent gave it)."""
        env, context = self.env, self.context
        self.membership.rank = rank
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % env.nproc_per_node), GROUP_RANK=str(env.node))
        context.serve(Replication(
            self.tracked.own, rank, self.placement, credentials=env.credentials(rank, certificate), host=env.host,
            replica_budget_bytes=self.options.replica_budget_bytes, protection=env.protection,
            snapshot_every=self.boundary.snapshot_every))
        if self.progress:  # if this process hangs, its replacement reads its stores from its memory
            self.progress.set_index_address(context.replication.index_stores())
        self.boundary.replication_serves_shares()  # a spare registered its share stores before its rank
        context.watch(EpochWatcher(self.channel.clone(), plan, self.aborts.on_new_epoch))
        try:
            self.joiner.join(plan)
        except Superseded:
            self.joiner.recover()

    def declare(self, what: str, make: Callable[[], Declared]) -> Declared:
        """A subgroup or mesh the script declares with ``what`` (``make()`` builds it, once
        the declaration is known to come in time): formed now if this epoch's group is,
        and in every epoch."""
        if self.tracked.tracking:
            raise InvalidArgumentError(f"call {what} before track(): a hot spare waits in track(), and every "
                                       "process must declare the same groups in the same order")
        if self.membership.replacement and self.membership.rank is not None:
            raise InvalidArgumentError(f"call {what} before wait_for_rank(): this replacement already formed its "
                                       "epoch's groups with the survivors, who will not create this one")
        declared = make()
        self.groups.add(declared, self.options.join_timeout)
        if not isinstance(declared, Subgroup):
            self.meshes.append(declared)
        return declared

    def track(self, objects: Dict[str, Any], extras: Mapping[str, Any], data_parallel: Union[bool, str]) -> None:
        """``Job.track``'s work up to waiting for a rank: register what is tracked (a
        spare or a replacement, allocating it too), or resume a new job from its disk
        checkpoint; the first optimizer step of each round starts its replication
        (and, 2 versions kept, each forward of a tracked module waits for its round;
        a normalisation layer's forward waits for the copy its statistics are in)."""
        self.boundary.wait_in_forwards(objects["model"])
        self.boundary.wait_copied_in_norms(objects["model"])
        replica_mesh, replica_dim = replica_dimension(self.meshes, data_parallel)
        self.tracked.track(**objects, extras=extras, data_parallel=bool(data_parallel), replica_mesh=replica_mesh,
                           replica_dim=replica_dim)
        self.wrappers.model = objects["model"]
        membership = self.membership
        resume = self.resume.point(new_job=not (membership.replacement or self.joiner.recoveries or
                                                membership.next_step))
        optimizers = optimizer_parts(objects["optimizer"])  # a container's or a list's optimizers, or it
        if membership.needs_state or resume:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            for part in optimizers:
                _init_optim_state(part)  # what a restore writes into must exist (a no-op once it does)
        if membership.needs_state:
            self.tracked.register(membership.rank)  # allocates too: a recovery should not fault memory in
            if self.context.ranked:
                self.boundary.replication_serves_shares()
        elif resume:
            membership.resumed_at(self.resume.load(*resume, membership.rank))
        for part in optimizers:  # the first to step starts the round; the others find it started
            part.register_step_pre_hook(lambda *_: self.boundary.start_replication())

    def restore_pending(self) -> None:
        """A replacement's restore, once its script has tracked what it restores into."""
        if self.restorer.pending is not None:
            with self.counting_recovery_errors():
                self.restorer.restore_pending()

    def wait_for_rank(self) -> None:
        """A spare: say it is ready, wait for a plan to give it a rank, and take it."""
        self.coordinator.register_spare(self.env.worker)
        self.events.write("spare_ready", pid=os.getpid())
        plan, rank, certificate = wait_for_assignment(self.channel, self.env.worker, self.options.join_timeout)
        self.events.write("spare_assigned", epoch=plan.epoch, rank=rank, job_store=self.kv.count.requests)
        with self.counting_recovery_errors():
            self.take_rank(plan, rank, certificate)

    def recover_if_due(self) -> None:
        """Between steps: recover if a failure was caught or a newer epoch began."""
        membership = self.membership
        if membership.state is MemberState.RECOVERING or self.context.watcher.latest.epoch != membership.epoch:
            self.aborts.loop_arrived()
            with self.progress.setting_up() if self.progress else contextlib.nullcontext(), \
                    self.counting_recovery_errors():
                self.joiner.recover()

    def step_guard(self) -> StepGuard:
        """The guard of the next step, once the checks before a step pass (a group
        created outside peerstate stops the job: a replacement would run into it too)."""
        undeclared = self.groups.describe_undeclared()
        if undeclared:
            raise InvalidArgumentError(self.coordinator.fail_job(f"rank {self.membership.rank}: {undeclared}"))
        self.checks.before_step(self.membership.next_step)
        return StepGuard(self.context, self.joiner, self.boundary, self.regroup, self.checks.step_ended)

    def finish(self, total: int) -> None:
        """The loop is done: drain the last snapshot, report, and count as finished
        (this process's death from here on is not a failure)."""
        self.membership.move(MemberState.FINISHED)
        self.boundary.drain()
        self.boundary.report_memory()  # what the run's summary shows
        self.report.finish(total, self.membership.epoch)
        if self.progress:
            self.progress.finish()

    def memory(self) -> Dict[str, int]:
        """``Job.memory``."""
        return self.boundary.memory()

    def counting_recovery_errors(self) -> Any:
        return counting_recovery_errors(self.kv, self.coordinator, self.membership, lambda: self.membership.next_step)

    def close(self) -> None:
        """Stop watching, serving and snapshotting, and give back what was claimed, in
        that order (the watcher first: no abort may start while the rest closes)."""
        self.context.close()
        self.wrappers.close(timeout=self.options.abort_timeout)
        self.groups.destroy()
        release_default_group()
        release_pg_timeouts()
        self.tracked.close()
        if self.progress:
            self.progress.exiting()
            self.progress.close()


def assemble(options: JobOptions) -> WorkerParts:
    """Build this process's parts from ``options`` and the environment its agent gave it
    (``WorkerEnvironment``); connects to the job's store and the node channel."""
    import torch

    untested = untested_torch()
    if untested:
        print(f"peerstate: {untested}", file=sys.stderr, flush=True)
    env = WorkerEnvironment.from_env()
    backend = options.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    join_timeout, abort_timeout = options.join_timeout, options.abort_timeout
    events = EventLog(env.events, env.worker)
    kv = open_store(env.store, timeout=join_timeout)  # TCPStore or etcd, as the agent says
    node_host, node_port = env.node_store.rsplit(":", 1)
    channel = TorchKeyValueStore(node_host, int(node_port), timeout=join_timeout)  # to its agent
    coordinator = Coordinator(kv)
    # A replacement would run into the same: the job stops, not just this rank.
    claim_default_group(lambda message: InvalidArgumentError(coordinator.fail_job(message)))
    nodes = [r // env.nproc_per_node for r in range(env.world_size)]
    placement = ParityPlacement(nodes, options.parity_group) if options.parity_group else \
        BuddyPlacement(nodes, k=options.k)
    progress = ProgressCounter(env.progress) if env.progress else None
    if progress:
        progress.start_ticking()
    permit_reads_by_the_node()  # its replacement reads its stores if it hangs, a same-node peer its share
    # gloo: a collective or a rendezvous that no abort wakes fails on its own well
    # before the deadline (the members reach form() together: a join is a barrier).
    groups = ProcessGroups(backend, collective_timeout=abort_timeout / 2,
                           connect_timeout=min(abort_timeout / 10, FORM_CONNECT_TIMEOUT))
    membership = Membership(env.worker, spare=env.spare)
    claim_pg_timeouts(groups, lambda message: report_finding(channel, membership.rank, env.worker, membership.next_step,
                                                             message, OVERRIDDEN))
    budget = HostMemoryBudget(*node_memory(), env.nproc_per_node, coordinator.fail_job)
    tracked = TrackedState(nodes, options.k, options.shares(), options.versions, options.snapshot_threads, budget,
                           options.parity_group)
    wrappers = DistributedWrappers(kv)
    checkpoints = DiskCheckpoints(tracked, wrappers, options.checkpoint_dir or env.checkpoint_dir,
                                  options.checkpoint_every or env.checkpoint_every, coordinator.fail_job)
    report = RecoveryReport(kv, channel, events, env.world_size)
    context = WorkerContext(membership, kv, channel, coordinator, events, report, placement, env.world_size,
                            join_timeout, options.failure_grace)
    boundary = StepBoundary(context, tracked, checkpoints, progress, options.snapshot_every, options.versions)
    # The same script without the capture, for the benchmarks' baselines (no failure is survivable).
    boundary.capture = os.environ.get("PEERSTATE_CAPTURE", "1") != "0"
    resume = CheckpointResume(kv, checkpoints, boundary, tracked, events)
    restorer = Restorer(context, tracked, checkpoints)
    regroup = BusyPeerRegroup(coordinator, groups, events, f"agent{env.node}", env.worker, env.world_size,
                              abort_timeout, join_timeout)
    joiner = EpochJoiner(context, groups, tracked, restorer, boundary, wrappers, checkpoints, regroup)
    on_new_epoch = [groups.abort, wrappers.abort, lambda epoch: context.replication.abort_transfers(),
                    boundary.on_new_epoch]
    aborts = AbortHandler(membership, on_new_epoch, events, abort_timeout, on_abort=report.marks.clear)
    checks = StepChecks(membership, tracked, UnguardedCollectives(groups.formed), channel, events)
    return WorkerParts(options, env, backend, events, kv, channel, coordinator, placement, progress, groups, membership,
                       tracked, wrappers, checkpoints, report, context, boundary, resume, restorer, regroup, joiner,
                       aborts, checks)

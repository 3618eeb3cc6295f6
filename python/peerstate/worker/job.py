"""The worker's side of a peerstate job: join, train, and turn failures into recoveries.

The whole integration with a training loop::

    job = peerstate.Job()
    model = Net(); optimizer = torch.optim.AdamW(model.parameters())
    job.track(model=model, optimizer=optimizer, scheduler=scheduler)  # a hot spare waits here
    ddp = job.ddp(model)                        # DistributedDataParallel, rebuilt after a recovery
    for step in job.steps(1000):                # resumes at v+1 after a recovery
        with job.guard():                       # a failure in here becomes a recovery
            loss = loss_fn(ddp(batch(step)))
            optimizer.zero_grad(); loss.backward(); optimizer.step()
    job.close()

What happens at each step boundary (the end of ``guard``): the step's state
is snapshotted as version ``step`` in the background, and the copy overlaps
the next step's forward and backward; ``optimizer.step()`` of the next step
waits for it (a pre-step hook) and then starts replicating it to the buddies,
which overlaps the rest of that step. Small state (RNG states, scheduler,
extras) is captured eagerly at the boundary.

What happens on a failure: the agent writes a plan for a new epoch; this
worker's watcher thread sees it within milliseconds and aborts the process
group and the replication transfers, so the loop's blocked call fails into
``guard``. The next turn of ``steps()`` then joins the new epoch: each member
hands its node agent a report of what it holds and gets back its instructions
(the recovery point v, the newest version held for every rank, computed once
by the epoch's plan writer: see ``control.node_relay``), re-forms the process
group, rolls back to v (survivors from
their own snapshot, the replacement by pulling it from the buddies; with
``data_parallel=True`` everyone also pulls the data-parallel shares it does
not snapshot itself), rebuild DDP and go on at step v+1, bit for bit the run
that never failed.

A hot spare runs the same script: ``Job()`` returns at once, the model and
optimizer are built ahead of time, and ``track()`` registers and allocates
everything and then waits for a rank (``job.rank`` is None until then), so a
replacement only has to pull its state. Code before ``track()`` must not
depend on the rank.

Data is addressed by step: the loop must draw batch ``step`` from the step
number (or from a loader given to ``track``, whose ``state_dict`` is captured),
so that a replayed step sees the same data.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.environment import WorkerEnvironment
from peerstate.control.findings import OVERRIDDEN, report_finding
from peerstate.control.kvstore import TorchKeyValueStore
from peerstate.control.stores import open_store
from peerstate.control.messages import RecoveryPlan
from peerstate.control.progress import ProgressCounter
from peerstate.control.timeline import EventLog
from peerstate.errors import InvalidArgumentError
from peerstate.replication.endpoint import Replication
from peerstate.replication.placement import BuddyPlacement
from peerstate.replication.stopped_holder import permit_reads_by_the_node
from peerstate.state.training_state import optimizer_parts
from peerstate.worker.abort import AbortHandler
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.context import WorkerContext
from peerstate.worker.host_budget import HostMemoryBudget, node_memory
from peerstate.worker.joiner import FORM_CONNECT_TIMEOUT, EpochJoiner, Superseded
from peerstate.worker.membership import EpochWatcher, Membership, MemberState, wait_for_assignment
from peerstate.worker.meshes import BuiltMeshes, DeclaredMesh, replica_dimension
from peerstate.worker.process_groups import ProcessGroups, Subgroup, claim_default_group, release_default_group
from peerstate.worker.rebuild import DistributedWrappers, RebuildableDDP
from peerstate.worker.regroup import BusyPeerRegroup
from peerstate.worker.report import RecoveryReport
from peerstate.worker.restorer import Restorer
from peerstate.worker.resume import CheckpointResume
from peerstate.worker.script_timeouts import claim_pg_timeouts, release_pg_timeouts
from peerstate.worker.unguarded import UnguardedCollectives
from peerstate.worker.step_boundary import StepBoundary
from peerstate.worker.step_guard import StepChecks, StepGuard, counting_recovery_errors
from peerstate.worker.torch_private import untested_torch
from peerstate.worker.tracked_state import TrackedState


class Job:
    """This process's membership in a peerstate job (see the module docstring).
    A script reads ``rank``, ``epoch``, ``next_step``, ``recoveries``, ``world_size``,
    ``backend``, ``capture``, ``extras`` and ``memory()``; the parts are private.

    Args:
        snapshot_every: snapshot (and replicate) every N steps; a failure costs at
            most N steps of work.
        versions: snapshot versions kept per rank, >= 4. A member's newest version
            (in flight) can be 3 ahead of the newest that another rank's buddy
            surely committed: that rank pushes v at the optimizer step of v+1,
            after waiting there for the push of v-1, so while it is inside step
            v+2 (which the member may have finished) only v-1 is certain. The
            member must then still hold v-1 to roll back to it.
        k: copies of each rank's state on other ranks.
        backend: "gloo" or "nccl" (default: nccl when CUDA is available).
        checkpoint_dir: where a disk checkpoint (torch.distributed.checkpoint) is
            written every ``checkpoint_every`` steps, the fallback when a failure
            takes every copy of some rank's state.
        join_timeout: seconds to wait for every member while joining an epoch.
        failure_grace: seconds an error in the loop that may be a peer's failure (a
            torch.distributed, gloo, NCCL or peerstate error) waits for the coordinator
            to declare one before it is treated as a bug and raised. Any other error is
            the script's own and is raised at once: the rank exits, and a spare takes it.
        abort_timeout: seconds the training loop may take, after a failure aborted
            the groups, to leave the call it is in and start the recovery. Past it
            this process exits with ``ABORT_DEADLINE_EXIT_CODE`` and a spare takes
            its rank: the last resort against a call no abort can wake (a kernel
            that never returns, a blocking call outside peerstate's groups).
            Shorter than ``join_timeout``; longer than the loop ever runs
            between two collectives. With gloo, collectives also time out after
            ``abort_timeout / 2`` (a send gloo was writing when its peer died
            waits for that timeout whatever the abort does; see
            ``process_groups``): raise it if ranks wait longer on each other.
            A collective that times out while every rank lives (a busy rank)
            makes the job regroup at the last common step with twice the
            timeout, said on stderr (``regroup``). Point-to-point waits (a
            pipeline's sends and receives) wait as long. And a gloo group's
            formation is given up when it completes no group for
            ``min(abort_timeout / 10, FORM_CONNECT_TIMEOUT)`` (2 s) at the start,
            or 0.5 s at most in a recovery (``RECOVERY_CONNECT_TIMEOUT``): a
            member that is late holds the others that long (one that died is
            ended by the next epoch's abort); a formation that times out with no
            member lost (one was late) makes the same members form it again in
            a new epoch (``EpochJoiner._form``).
        data_parallel_shares: with ``track(data_parallel=...)``, how many shares the
            data-parallel state is split into for snapshots (``DataParallelShares``):
            the i-th rank of a node snapshots share i % shares. Default: one share
            per rank of a node when the job has two nodes or more (each node keeps
            one full copy), else 1 (every rank keeps a full copy); under HSDP, 1.
            Fewer bytes per step per rank; a recovery pulls the shares a rank
            lacks. Also read from ``PEERSTATE_DATA_PARALLEL_SHARES``; checked at
            ``track()``.
        replica_budget_bytes, snapshot_threads: passed to the stores.
    """

    def __init__(self, *, snapshot_every: int = 1, versions: int = 4, k: int = 1, backend: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0, join_timeout: float = 120.0,
                 failure_grace: float = 30.0, replica_budget_bytes: Optional[int] = None,
                 snapshot_threads: Optional[int] = None, abort_timeout: float = 60.0,
                 data_parallel_shares: Optional[int] = None) -> None:
        if not 0 < abort_timeout < join_timeout:
            raise InvalidArgumentError(f"abort_timeout must be positive and shorter than join_timeout, which the "
                                       f"other members wait for this one (got {abort_timeout} and {join_timeout})")
        if snapshot_every < 1 or versions < 4:
            raise InvalidArgumentError(f"need snapshot_every >= 1 and versions >= 4 (got {snapshot_every}, "
                                       f"{versions}): fewer versions can leave no step that every rank still holds")
        if checkpoint_every and not checkpoint_dir:
            raise InvalidArgumentError("checkpoint_every needs a checkpoint_dir")
        import torch

        untested = untested_torch()
        if untested:
            print(f"peerstate: {untested}", file=sys.stderr, flush=True)
        self._env = env = WorkerEnvironment.from_env()
        self.world_size, self._worker = env.world_size, env.worker
        self._join_timeout, self._abort_timeout = join_timeout, abort_timeout
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._replica_budget_bytes = replica_budget_bytes
        self._events = EventLog(env.events, env.worker)
        self._kv = open_store(env.store, timeout=join_timeout)  # TCPStore or etcd, as the agent says
        node_host, node_port = env.node_store.rsplit(":", 1)
        self._channel = TorchKeyValueStore(node_host, int(node_port), timeout=join_timeout)  # to its agent
        self._coordinator = Coordinator(self._kv)
        # A replacement would run into the same: the job stops, not just this rank.
        claim_default_group(lambda message: InvalidArgumentError(self._coordinator.fail_job(message)))
        nodes = [r // env.nproc_per_node for r in range(env.world_size)]
        self._placement = BuddyPlacement(nodes, k=k)
        if data_parallel_shares is None and os.environ.get("PEERSTATE_DATA_PARALLEL_SHARES"):
            data_parallel_shares = int(os.environ["PEERSTATE_DATA_PARALLEL_SHARES"])
        self._progress = ProgressCounter(env.progress) if env.progress else None
        if self._progress:
            self._progress.start_ticking()
        permit_reads_by_the_node()  # its replacement reads its stores if it hangs, a same-node peer its share
        # gloo: a collective or a rendezvous that no abort wakes fails on its own well
        # before the deadline (the members reach form() together: a join is a barrier).
        self._groups = ProcessGroups(self.backend, collective_timeout=abort_timeout / 2,
                                     connect_timeout=min(abort_timeout / 10, FORM_CONNECT_TIMEOUT))
        claim_pg_timeouts(self._groups, lambda message: report_finding(self._channel, self.rank, self._worker,
                                                                       self.next_step, message, OVERRIDDEN))
        self._membership = Membership(env.worker, spare=env.spare)
        budget = HostMemoryBudget(*node_memory(), env.nproc_per_node, self._coordinator.fail_job)
        self._tracked = TrackedState(nodes, k, data_parallel_shares, versions, snapshot_threads, budget)
        self._meshes: List[Union[DeclaredMesh, BuiltMeshes]] = []
        self._wrappers = DistributedWrappers(self._kv)
        self._checkpoints = checkpoints = DiskCheckpoints(self._tracked, self._wrappers,
                                                          checkpoint_dir or env.checkpoint_dir,
                                                          checkpoint_every or env.checkpoint_every,
                                                          self._coordinator.fail_job)
        self._report = RecoveryReport(self._kv, self._channel, self._events, env.world_size)
        self._context = context = WorkerContext(self._membership, self._kv, self._channel, self._coordinator,
                                                self._events, self._report, self._placement, env.world_size,
                                                join_timeout, failure_grace)
        self._boundary = StepBoundary(context, self._tracked, checkpoints, self._progress, snapshot_every)
        # The same script without the capture, for the benchmarks' baselines (no failure is survivable).
        self.capture = os.environ.get("PEERSTATE_CAPTURE", "1") != "0"
        self._resume = CheckpointResume(self._kv, checkpoints, self._boundary, self._tracked, self._events)
        self._restorer = Restorer(context, self._tracked, checkpoints)
        self._regroup = BusyPeerRegroup(self._coordinator, self._groups, self._events, f"agent{env.node}",
                                        env.worker, env.world_size, abort_timeout, join_timeout)
        self._joiner = EpochJoiner(context, self._groups, self._tracked, self._restorer, self._boundary, self._wrappers,
                                   checkpoints, self._regroup)
        aborts = [self._groups.abort, self._wrappers.abort, lambda epoch: context.replication.abort_transfers(),
                  self._boundary.on_new_epoch]
        self._aborts = AbortHandler(self._membership, aborts, self._events, abort_timeout,
                                    on_abort=self._report.marks.clear)
        self._guard: Optional[StepGuard] = None  # the current step's
        self._checks = StepChecks(self._membership, self._tracked, UnguardedCollectives(self._groups.formed),
                                  self._channel, self._events)
        atexit.register(self.close)  # an exception out of the loop still stops the threads in order
        if env.spare:
            _warm_up()
        else:
            self._become_member(self._plan(0), env.rank)

    # -- what the script reads -----------------------------------------------------
    @property
    def rank(self) -> Optional[int]:
        """This process's rank (None while a spare waits for one)."""
        return self._membership.rank

    @property
    def epoch(self) -> int:
        return self._membership.epoch

    @property
    def next_step(self) -> int:
        """The step the loop runs next."""
        return self._joiner.next_step

    @property
    def recoveries(self) -> int:
        return self._joiner.recoveries

    @property
    def capture(self) -> bool:
        """False: steps are not snapshotted (for overhead measurements only; also set by
        ``PEERSTATE_CAPTURE=0``, which the benchmarks use to run a script without it)."""
        return self._boundary.capture

    @capture.setter
    def capture(self, value: bool) -> None:
        self._boundary.capture = value

    # -- the loop --------------------------------------------------------------------
    def ddp(self, model: Any, **options: Any) -> RebuildableDDP:
        """Wrap ``model`` in a ``DistributedDataParallel`` (``options`` are DDP's), which
        the job rebuilds in place on every re-formed group: the same object, a real
        DDP subclass, keeping what the script set on it (``RebuildableDDP``). A
        replacement skips DDP's initial broadcast: its state arrives from the buddies."""
        self.wait_for_rank()
        return self._wrappers.wrap(model, options, self.epoch, self._membership.replacement, self._join_timeout)

    def new_group(self, ranks: Sequence[int], **options: Any) -> Subgroup:
        """Declare a process group over some ranks (``torch.distributed.new_group``'s
        ``ranks`` and options): peerstate aborts it with the default group when a
        failure hits and forms it again in every epoch. Every process calls it, in
        the same order, before ``track()`` (a spare too: it forms its subgroups when
        it is given a rank). Pass ``subgroup.group`` to collectives."""
        self._check_declaration("new_group()")
        subgroup = Subgroup.declared(ranks, options, self.world_size)
        self._groups.add(subgroup, self._join_timeout)
        return subgroup

    def device_mesh(self, device_type: str, mesh_shape: Sequence[int], *,
                    mesh_dim_names: Optional[Sequence[str]] = None) -> DeclaredMesh:
        """Declare a ``DeviceMesh`` (``init_device_mesh``'s arguments) whose groups
        peerstate aborts on a failure and re-forms in every epoch; ``.mesh`` is the
        torch ``DeviceMesh``, the same object across recoveries (see ``meshes``).
        The same rules as ``new_group``: every process, same order, before
        ``track()``; a spare's ``.mesh`` exists once ``wait_for_rank()`` returns."""
        self._check_declaration("device_mesh()")
        declared = DeclaredMesh.declared(device_type, mesh_shape, mesh_dim_names, self.world_size)
        self._groups.add(declared, self._join_timeout)
        self._meshes.append(declared)
        return declared

    def build_meshes(self, builder: Callable[[], Any], *,
                     layout: Optional[Sequence[Tuple[str, int]]] = None) -> BuiltMeshes:
        """Declare the script's own mesh builder: a function that builds every mesh it
        needs with torch's DeviceMesh API (``init_device_mesh``, ``_unflatten``,
        ``_flatten``, slicing, ``backend_override``) and returns them, as torchtitan's
        ``ParallelDims.build_mesh`` does. peerstate runs it now (a spare: once it has a
        rank) and again in every epoch after its own groups, and aborts and re-forms
        its groups with them; ``.value`` is what the first call returned, valid across
        recoveries (see ``meshes``). ``layout``: the world mesh's (name, size) pairs, for
        ``track(data_parallel=NAME)``. The same rules as ``new_group``."""
        self._check_declaration("build_meshes()")
        built = BuiltMeshes.declared(builder, layout, self.world_size)
        self._groups.add(built, self._join_timeout)
        self._meshes.append(built)
        return built

    def _check_declaration(self, what: str) -> None:
        if self._tracked.tracking:
            raise InvalidArgumentError(f"call {what} before track(): a hot spare waits in track(), and every "
                                       "process must declare the same groups in the same order")
        if self._membership.replacement and self.rank is not None:
            raise InvalidArgumentError(f"call {what} before wait_for_rank(): this replacement already formed its "
                                       "epoch's groups with the survivors, who will not create this one")

    def track(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, loader: Any = None,
              extras: Optional[Mapping[str, Any]] = None, data_parallel: Union[bool, str] = False) -> None:
        """Say what the training state is. ``scheduler`` and ``loader`` need
        ``state_dict()``/``load_state_dict()``; the RNG states of Python, NumPy,
        torch and CUDA are always captured. Each of ``extras`` is an object with
        both methods (restored in place) or a plain picklable value (a best
        validation loss, a counter): read and write those through ``job.extras``
        (``job.extras["best_loss"] = loss``), which a restore sets back.

        Optimizer state appears at the first step, so a worker registers it at the
        first step boundary. A hot spare runs the script up to here ahead of time:
        it materialises the optimizer state, registers and allocates everything,
        and only then waits for a rank, so code before ``track()`` must not depend
        on the rank. Once given one it pulls the state and returns.

        ``data_parallel=True`` says that model, optimizer and scheduler state are the
        same on every rank (DistributedDataParallel): they are then not replicated;
        each rank snapshots its share of them (``data_parallel_shares``), and a rank
        that recovers pulls the shares it lacks from the surviving ranks' own
        snapshots (no replication traffic, no extra memory). Only each rank's own
        state (RNG, loader, extras) goes to its buddies. ``data_parallel`` may
        instead name a dimension of a mesh declared with ``device_mesh``: that state
        is then the same on the ranks along it (HSDP: ``"replicate"``, where the
        rank at the same place of every replica group holds the same shard), which
        are each other's copies in the same way."""
        replica_mesh, replica_dim = replica_dimension(self._meshes, data_parallel)
        self._tracked.track(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                           extras=extras or {}, data_parallel=bool(data_parallel), replica_mesh=replica_mesh,
                           replica_dim=replica_dim)
        self._wrappers.model = model
        resume = self._resume.point(new_job=not (self._membership.replacement or self.recoveries or self.next_step))
        optimizers = optimizer_parts(optimizer)  # a container's or a list's optimizers, or it
        if self._membership.needs_state or resume:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            for part in optimizers:
                _init_optim_state(part)  # what a restore writes into must exist (a no-op once it does)
        if self._membership.needs_state:
            self._tracked.register(self.rank)  # allocates too: a recovery should not fault memory in
            if self._context.replication is not None:
                self._boundary.replication_serves_shares()
        elif resume:
            self._joiner.next_step = self._resume.load(*resume, self.rank)
        for part in optimizers:  # the first to step starts the round; the others find it started
            part.register_step_pre_hook(lambda *_: self._boundary.start_replication())
        self.wait_for_rank()
        if self._restorer.pending is not None:
            with self._counting_recovery_errors():
                self._restorer.restore_pending()

    @property
    def extras(self) -> Dict[str, Any]:
        """The ``extras`` given to ``track()``, by name; a plain value is snapshotted
        from here at each step boundary and set back here by a restore."""
        return self._tracked.extras

    def memory(self) -> Dict[str, int]:
        """Host memory this rank holds for recoveries, in bytes: ``snapshot_per_version``
        (what it copies each step: its own state and its share of the data-parallel
        state), ``snapshots_held`` (the version slots of all its stores, as allocated
        now), ``replicas_held`` and ``replicas_reserved`` (its buddies' state kept
        here; 0 for a spare without a rank)."""
        replicas = self._context.replication.replicas if self._context.replication is not None else None
        return {**self._tracked.memory(self.rank), "replicas_held": replicas.held_bytes() if replicas else 0,
                "replicas_reserved": replicas.reserved_bytes() if replicas else 0}

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers from where the job stands (0, or the step after the disk
        checkpoint a new job resumed from in ``track()``) to ``total`` - 1, recovering
        between steps when a failure was caught by ``guard``."""
        while True:
            if self._membership.state is MemberState.RECOVERING or self._context.watcher.latest.epoch != self.epoch:
                self._aborts.loop_arrived()
                with self._progress.setting_up() if self._progress else contextlib.nullcontext(), \
                        self._counting_recovery_errors():
                    self._joiner.recover()
            if self.next_step >= total:
                break
            self._guard = None
            yield self.next_step
            if self._guard is None and self._membership.state is not MemberState.RECOVERING:
                raise InvalidArgumentError("wrap the body of the steps() loop in `with job.guard():`")
        self._membership.move(MemberState.FINISHED)
        self._boundary.drain()
        self._events.write("memory", rank=self.rank, **self.memory())  # what the run's summary shows
        self._report.finish(total, self.epoch)
        if self._progress:
            self._progress.finish()  # counted as finished: its death from here on is not a failure

    def _counting_recovery_errors(self) -> Any:
        return counting_recovery_errors(self._kv, self._coordinator, self._membership, lambda: self._joiner.next_step)

    def guard(self) -> StepGuard:
        """Context manager for one step's body: a failure inside becomes a recovery."""
        undeclared = self._groups.describe_undeclared()
        if undeclared:  # a replacement would run into the same: the job stops
            raise InvalidArgumentError(self._coordinator.fail_job(f"rank {self.rank}: {undeclared}"))
        self._checks.before_step(self.next_step)
        self._guard = StepGuard(self._context, self._joiner, self._boundary, self._regroup, self._checks.step_ended)
        return self._guard

    def guarded(self, step_function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: every call runs in ``guard()``. For a loop whose body moves into a
        function as it is, without re-indenting it under a ``with``::

            @job.guarded
            def train_step(step):
                ...                                # the old loop body, unchanged
            for step in job.steps(total_steps):
                train_step(step)

        A call returns the function's result, or None when a failure interrupted it
        (the step is then replayed by the recovery). Names the body rebinds across
        steps need ``global`` (or ``job.extras``) there, as in any function."""
        @functools.wraps(step_function)
        def run_guarded(*args: Any, **kwargs: Any) -> Any:
            with self.guard():
                return step_function(*args, **kwargs)

        return run_guarded

    def wait_for_rank(self) -> int:
        """A spare: block until a plan gives this process a rank (a worker returns at
        once). Call it before building anything that needs the process group, such
        as FSDP2's ``fully_shard``; the spare is then less ready (it builds its model
        after being picked). Returns the rank."""
        if self.rank is not None:
            return self.rank
        self._coordinator.register_spare(self._worker)
        self._events.write("spare_ready", pid=os.getpid())
        plan, rank, certificate = wait_for_assignment(self._channel, self._worker, self._join_timeout)
        self._events.write("spare_assigned", epoch=plan.epoch, rank=rank, job_store=self._kv.count.requests)
        with self._counting_recovery_errors():
            self._become_member(plan, rank, certificate)
        return self.rank

    def _plan(self, epoch: int) -> RecoveryPlan:
        """Epoch ``epoch``'s plan, from the agent's copy in the node channel."""
        key = keys.epoch_plan(epoch)
        self._channel.wait([key], timeout=self._join_timeout)
        return RecoveryPlan.decode(self._channel.get(key))

    # -- membership ------------------------------------------------------------------
    def _become_member(self, plan: RecoveryPlan, rank: int, certificate: Optional[bytes] = None) -> None:
        """Take ``rank`` in ``plan``'s epoch (or a newer one) and join it (a spare:
        with the ``certificate`` of that rank its agent gave it)."""
        self._membership.rank = rank
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % self._env.nproc_per_node),
                          GROUP_RANK=str(self._env.node))
        credentials = self._env.credentials(rank, certificate)
        self._context.replication = Replication(
            self._tracked.own, rank, self._placement, credentials=credentials, host=self._env.host,
            replica_budget_bytes=self._replica_budget_bytes, protection=self._env.protection,
            snapshot_every=self._boundary.snapshot_every)
        if self._progress:  # if this process hangs, its replacement reads its stores from its memory
            self._progress.set_index_address(self._context.replication.index_stores())
        self._boundary.replication_serves_shares()  # a spare registered its share stores before its rank
        self._context.watcher = EpochWatcher(self._channel.clone(), plan, self._aborts.on_new_epoch)
        try:
            self._joiner.join(plan)
        except Superseded:
            self._joiner.recover()

    def close(self) -> None:
        """Stop watching, serving and snapshotting (call once the loop is done)."""
        if self._membership.state is MemberState.CLOSED:
            return
        self._membership.move(MemberState.CLOSED)
        if self._context.watcher is not None:
            self._context.watcher.stop()
        if self._context.replication is not None:
            self._context.replication.close()
        self._wrappers.close(timeout=self._abort_timeout)
        self._groups.destroy()
        release_default_group()
        release_pg_timeouts()
        self._tracked.close()
        if self._progress:
            self._progress.exiting()
            self._progress.close()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _warm_up() -> None:
    """What a spare does while it waits: import what the first optimizer (torch._dynamo,
    about a second), DDP and checkpointing import lazily, so a replacement starts warm."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.nn.parallel  # noqa: F401

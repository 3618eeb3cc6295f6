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
``guard``. The next turn of ``steps()`` then joins the new epoch: members
report what they hold, agree on the recovery point v (the newest version held
for every rank), re-form the process group, roll back to v (survivors from
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
import faulthandler
import json
import os
import random
import statistics
import sys
import threading
import time
import warnings
from typing import Any, Callable, Container, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from peerstate.buffers import ByteRange
from peerstate.coordinator import (Coordinator, MemberReport, RecoveryPlan, node_of_worker, recovery_point,
                                   same_node_regions, share_sources, sources_of)
from peerstate.errors import AbortedError, InvalidArgumentError, JobFailedError, StateLostError
from peerstate.kvstore import TorchKeyValueStore
from peerstate.placement import BuddyPlacement, DataParallelShares, PlacementWarning
from peerstate.process_groups import ProcessGroups, Subgroup
from peerstate.progress import ProgressCounter
from peerstate.replication import Replication
from peerstate.snapshot import SnapshotStore
from peerstate.state_dict import training_state
from peerstate.timeline import EventLog, read_events, recovery_timeline

# A worker that could not leave a blocked call within Job(abort_timeout=...) exits with this (EX_SOFTWARE).
ABORT_DEADLINE_EXIT_CODE = 70


class _Superseded(Exception):
    """A newer epoch began while this one was being joined."""


class EpochWatcher:
    """Blocks on the next epoch's plan key (its own store connection) and calls
    ``on_epoch(plan)`` from its thread the moment the plan appears."""

    def __init__(self, kv: TorchKeyValueStore, plan: RecoveryPlan, on_epoch: Callable[[RecoveryPlan], None]) -> None:
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
            key = f"epoch/{self._latest.epoch + 1}/plan"
            try:
                self._kv.wait([key], timeout=1.0)
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
        self._thread.join(timeout=3.0)


class RebuildableDDP:
    """A DistributedDataParallel that the job rebuilds on each re-formed process
    group. Call it and use its attributes as the DDP module itself.

    Why the bucket layout is carried over: a fresh DDP reduces its first
    iteration in buckets laid out in parameter order and only then re-buckets
    by the order gradients became ready. Where a gradient element sits in a
    bucket decides the order gloo/NCCL sum it across ranks, so that first
    iteration would differ from a never-rebuilt DDP in the last bit (with 3 or
    more ranks). A rebuilt DDP is therefore built with the layout the old one
    had settled on, and a replacement receives it from the survivors.
    """

    def __init__(self, module: Any, init_sync: bool, options: Dict[str, Any],
                 layout: Optional[List[List[int]]] = None) -> None:
        self.__dict__.update(_module=module, _options=options, _ddp=None, _layout=None)
        self.rebuild(init_sync, layout)

    def rebuild(self, init_sync: bool = False, layout: Optional[List[List[int]]] = None) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.release()
        compute = dist._compute_bucket_assignment_by_size
        if layout:
            def settled(params: Any, limits: List[int], *args: Any, **kwargs: Any) -> Tuple[list, list]:
                # DDP reverses what this returns, so hand it the layout reversed.
                per_bucket = [limits[min(i, len(limits) - 1)] for i in range(len(layout))]
                return list(reversed(layout)), list(reversed(per_bucket))

            dist._compute_bucket_assignment_by_size = settled
        try:
            self.__dict__["_ddp"] = DistributedDataParallel(self._module, init_sync=init_sync, **self._options)
        finally:
            dist._compute_bucket_assignment_by_size = compute
        self.__dict__["_layout"] = layout

    def bucket_layout(self) -> Optional[List[List[int]]]:
        """The parameter indices of each bucket, as the DDP reduces them now."""
        if self._ddp is None:
            return self._layout
        data = self._ddp._get_ddp_logging_data()
        if not data.get("has_rebuilt_buckets"):
            return self._layout
        return [[int(i) for i in bucket.split()] for bucket in data["rebuilt_per_bucket_param_indices"].split(",")]

    def release(self) -> None:
        """Drop the DDP of an aborted group. Its reducer's gradient hooks are removed
        now: the DDP may live on in reference cycles until the next gc, and its
        hooks must not fire into the aborted group."""
        if self._ddp is not None:
            self.__dict__["_layout"] = self.bucket_layout()
            self._ddp.reducer._remove_autograd_hooks()
        self.__dict__["_ddp"] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ddp(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_ddp"], name)


class _Environment:
    """What ``peerstate run`` passes to each process it starts."""

    def __init__(self) -> None:
        env = os.environ
        if "PEERSTATE_STORE" not in env:
            raise InvalidArgumentError(
                "peerstate.Job() runs in a process started by `peerstate run` (PEERSTATE_STORE is not set); "
                "start the script with: peerstate run --nproc-per-node N --spares S script.py")
        host, port = env["PEERSTATE_STORE"].rsplit(":", 1)
        self.store_host, self.store_port = host, int(port)
        self.worker = env["PEERSTATE_WORKER"]
        self.role = env.get("PEERSTATE_ROLE", "worker")
        self.world_size = int(env["WORLD_SIZE"])
        self.nproc_per_node = int(env["LOCAL_WORLD_SIZE"])
        self.host = env.get("PEERSTATE_HOST", "127.0.0.1")
        self.progress = env.get("PEERSTATE_PROGRESS")
        self.events = env.get("PEERSTATE_EVENTS")
        self.secret = bytes.fromhex(env["PEERSTATE_SECRET"]) if "PEERSTATE_SECRET" in env else None


class Job:
    """This process's membership in a peerstate job (see the module docstring).

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
        failure_grace: seconds an error in the loop may wait for the coordinator to
            declare a failure before it is treated as a bug and raised.
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
            And a gloo group is created under ``abort_timeout / 10``: a member
            that dies inside the re-forming holds the others up to five times
            that (gloo's connect wait), again ``abort_timeout / 2``.
        data_parallel_shares: with ``track(data_parallel=True)``, how many shares the
            data-parallel state is split into for snapshots (``DataParallelShares``):
            the i-th rank of a node snapshots share i % shares. Default: one share
            per rank of a node when the job has two nodes or more (each node keeps
            one full copy), else 1 (every rank keeps a full copy). Fewer bytes per
            step per rank; a recovery pulls the shares a rank lacks. Also read
            from ``PEERSTATE_DATA_PARALLEL_SHARES``.
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

        self._env = env = _Environment()
        self.snapshot_every = snapshot_every
        self.checkpoint_dir = checkpoint_dir or os.environ.get("PEERSTATE_CHECKPOINT_DIR")
        self.checkpoint_every = checkpoint_every or int(os.environ.get("PEERSTATE_CHECKPOINT_EVERY", "0"))
        self.join_timeout = join_timeout
        self.failure_grace = failure_grace
        self.abort_timeout = abort_timeout
        self.world_size = env.world_size
        self.worker = env.worker
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.events = EventLog(env.events, env.worker)
        self.kv = TorchKeyValueStore(env.store_host, env.store_port, timeout=join_timeout)
        self.coordinator = Coordinator(self.kv)
        nodes = [r // env.nproc_per_node for r in range(env.world_size)]
        self.placement = BuddyPlacement(nodes, k=k)
        # Data-parallel state is the same on every rank: its copies are the other ranks' own snapshots.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlacementWarning)
            self.shared_placement = BuddyPlacement(nodes, k=1, replica_groups=[list(range(env.world_size))])
        if data_parallel_shares is None and os.environ.get("PEERSTATE_DATA_PARALLEL_SHARES"):
            data_parallel_shares = int(os.environ["PEERSTATE_DATA_PARALLEL_SHARES"])
        if data_parallel_shares is None:
            data_parallel_shares = env.nproc_per_node if len(set(nodes)) > 1 else 1
        self.shares = DataParallelShares(nodes, data_parallel_shares)
        self.progress = ProgressCounter(env.progress) if env.progress else None
        if self.progress:
            self.progress.start_ticking()
        self._secret = env.secret or bytes.fromhex(self.kv.get("job/secret").decode())
        self._replica_budget_bytes = replica_budget_bytes
        self.snapshots = SnapshotStore(max_versions=versions, threads=snapshot_threads)  # this rank's own state
        self._versions, self._snapshot_threads = versions, snapshot_threads
        self.shared: List[SnapshotStore] = []  # the data-parallel state, one store per share
        # gloo: a collective or a rendezvous that no abort wakes fails on its own well
        # before the deadline (the members reach form() together: _join is a barrier).
        self.groups = ProcessGroups(self.backend, collective_timeout=abort_timeout / 2,
                                    connect_timeout=abort_timeout / 10)
        self.rank: Optional[int] = None  # a spare learns its rank when it is given one
        self.epoch = -1
        self._epoch_lock = threading.Lock()  # orders the watcher's aborts with the joins of epochs
        self.next_step = 0
        self.recoveries = 0
        self.capture = True  # False: steps are not snapshotted (for overhead measurements only)
        self._registered = False
        self._needs_state = env.role == "spare"  # a spare's state comes from the buddies
        self._pending_restore: Optional[Tuple[str, int, Any]] = None  # ("pull"|"checkpoint", version, where)
        self._pending_replication: Optional[int] = None
        self._failing_holders: Dict[int, Optional[str]] = {}  # holder -> why its last push failed
        self._tracked: Dict[str, Any] = {}
        self._ddps: List[RebuildableDDP] = []
        self._needs_recovery = False
        self._in_recovery = False  # the main thread is in _recover(), not in the user's loop
        self._loop_done = False
        self._guarded = False
        self._marks: Dict[str, float] = {}
        self._first_step_after: Optional[int] = None
        self._pulled: Optional[Dict[str, Any]] = None  # the last recovery's data-parallel pulls, for the event log
        self._step_seconds: List[float] = []
        self._start_recorded = False
        self._closed = False
        self._replacement = False
        self.watcher: Optional[EpochWatcher] = None
        self.replication: Optional[Replication] = None
        self.shared_replication: List[Replication] = []  # one per share, as self.shared
        self._data_parallel = False
        atexit.register(self.close)  # an exception out of the loop still stops the threads in order
        if env.role != "spare":
            self.kv.wait(["epoch/0/plan"], timeout=self.join_timeout)
            self._become_member(self.coordinator.plan(0), int(os.environ["RANK"]))
        else:
            _warm_up()

    def _become_member(self, plan: RecoveryPlan, rank: int) -> None:
        """Take ``rank`` in ``plan``'s epoch (or a newer one) and join it."""
        self.rank = rank
        self._replacement = self._needs_state
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % self._env.nproc_per_node),
                          GROUP_RANK=str(node_of_worker(self.worker)))
        self._create_share_stores()
        self.replication = Replication(self.snapshots, rank, self.placement, secret=self._secret,
                                       host=self._env.host, replica_budget_bytes=self._replica_budget_bytes)
        self.shared_replication = [Replication(store, rank, self.shared_placement, secret=self._secret,
                                               host=self._env.host) for store in self.shared]
        self.watcher = EpochWatcher(self.kv.clone(), plan, self._on_new_epoch)
        self._in_recovery = True
        try:
            self._join(plan)
        except _Superseded:
            self._recover()
        finally:
            self._in_recovery = False

    # -- the loop --------------------------------------------------------------------
    def ddp(self, model: Any, **options: Any) -> RebuildableDDP:
        """Wrap ``model`` in DistributedDataParallel; the job rebuilds it on every
        re-formed group. A replacement skips DDP's initial broadcast: its state
        arrives from the buddies."""
        self._wait_for_rank()
        layout = None
        if self._replacement:  # the survivors publish the bucket layout their DDP settled on
            key = f"epoch/{self.epoch}/ddp/{len(self._ddps)}"
            self.kv.wait([key], timeout=self.join_timeout)
            layout = json.loads(self.kv.get(key))
        wrapper = RebuildableDDP(model, init_sync=self.epoch == 0, options=options, layout=layout)
        self._ddps.append(wrapper)
        return wrapper

    def new_group(self, ranks: Sequence[int], **options: Any) -> Subgroup:
        """Declare a process group over some ranks (``torch.distributed.new_group``'s
        ``ranks`` and options): peerstate aborts it with the default group when a
        failure hits and forms it again in every epoch. Every process calls it, in
        the same order, before ``track()`` (a spare too: it forms its subgroups when
        it is given a rank). Pass ``subgroup.group`` to collectives."""
        if self._tracked:
            raise InvalidArgumentError("declare subgroups with new_group() before track(): a hot spare waits in "
                                       "track(), and every process must declare the same groups in the same order")
        ranks = list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise InvalidArgumentError(f"new_group() needs distinct ranks in [0, {self.world_size}), got {ranks}")
        subgroup = Subgroup(ranks, options)
        self.groups.add(subgroup, self.join_timeout)
        return subgroup

    def track(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, loader: Any = None,
              extras: Optional[Mapping[str, Any]] = None, data_parallel: bool = False) -> None:
        """Say what the training state is. ``scheduler``, ``loader`` and each of
        ``extras`` need ``state_dict()``/``load_state_dict()``; the RNG states of
        Python, NumPy, torch and CUDA are always captured.

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
        state (RNG, loader, extras) goes to its buddies."""
        self._data_parallel = data_parallel
        self._tracked = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader,
                         "extras": dict(extras or {})}
        if self._needs_state:
            if optimizer is not None and not optimizer.state:
                from torch.distributed.checkpoint.state_dict import _init_optim_state

                _init_optim_state(optimizer)
            self._register()  # allocates too: a recovery should not fault memory in
        if optimizer is not None:
            optimizer.register_step_pre_hook(lambda *_: self._start_replication())
        self._wait_for_rank()
        if self._pending_restore is not None:
            self._restore_pending()

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers from where the job stands to ``total`` - 1, recovering
        between steps when a failure was caught by ``guard``."""
        while True:
            if self._needs_recovery or self.watcher.latest.epoch != self.epoch:
                self._recover()
            if self.next_step >= total:
                break
            self._guarded = False
            yield self.next_step
            if not self._guarded and not self._needs_recovery:
                raise InvalidArgumentError("wrap the body of the steps() loop in `with job.guard():`")
        self._finish(total)

    def guard(self) -> "_Guard":
        """Context manager for one step's body: a failure inside becomes a recovery."""
        return _Guard(self)

    # -- joining an epoch -----------------------------------------------------------
    def wait_for_rank(self) -> int:
        """A spare: block until a plan gives this process a rank (a worker returns at
        once). Call it before building anything that needs the process group, such
        as FSDP2's ``fully_shard``; the spare is then less ready (it builds its model
        after being picked). Returns the rank."""
        self._wait_for_rank()
        return self.rank

    def _wait_for_rank(self) -> None:
        """A spare: join the pool and block until a plan gives this process a rank."""
        if self.rank is not None:
            return
        self.coordinator.register_spare(self.worker)
        self.events.write("spare_ready")
        key = f"assign/{self.worker}"
        while True:
            try:
                self.kv.wait([key], timeout=5.0)
                break
            except TimeoutError:
                if self.coordinator.failure():
                    raise JobFailedError(f"the job stopped while this spare waited: {self.coordinator.failure()}")
        assignment = json.loads(self.kv.get(key))
        self.events.write("spare_assigned", **assignment)
        self._become_member(self.coordinator.plan(assignment["epoch"]), assignment["rank"])

    def _on_new_epoch(self, plan: RecoveryPlan) -> None:
        """Watcher thread: make the loop's blocked calls fail now, and give the loop
        ``abort_timeout`` seconds to come into the recovery.

        The loop can be first: a peer's death fails its collective, it sees the plan
        and joins the epoch before this thread gets the CPU. Aborting then would hit
        the epoch's fresh transports and group, so under ``_epoch_lock`` (which the
        join holds while it replaces them) an epoch already joined is left alone."""
        with self._epoch_lock:
            if self.epoch >= plan.epoch:
                return
            self._marks = {}
            deadline = threading.Timer(self.abort_timeout, self._abort_deadline, args=(plan.epoch,))
            deadline.daemon = True
            deadline.start()
            self.groups.abort(plan.epoch)
            for replication in (self.replication, *self.shared_replication):
                replication.abort_transfers()
        self.events.write("epoch_seen", epoch=plan.epoch, rank=self.rank)

    def _abort_deadline(self, epoch: int) -> None:
        """Timer thread: the loop has not left its call since ``epoch`` began. The
        other members wait for this rank's report; better a spare in its place now
        than all of them at their join timeout."""
        if self._in_recovery or self.epoch >= epoch or self._loop_done or self._closed:
            return
        message = (f"rank {self.rank}: the training loop did not leave its call within abort_timeout="
                   f"{self.abort_timeout:g}s of epoch {epoch}'s abort; this process exits so that a spare takes "
                   "its place")
        self.events.write("abort_deadline_missed", epoch=epoch, rank=self.rank)
        print(f"peerstate: {message}; where each thread was:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(ABORT_DEADLINE_EXIT_CODE)

    def _recover(self) -> None:
        self._in_recovery = True
        try:
            while True:
                plan = self.watcher.latest
                try:
                    self._join(plan)
                    break
                except _Superseded:
                    continue
        finally:
            self._in_recovery = False
        self._needs_recovery = False

    def _join(self, plan: RecoveryPlan) -> None:
        """Join ``plan``'s epoch: report, agree on the recovery point, re-form, restore."""
        if plan.members.get(self.rank) != self.worker:
            raise JobFailedError(f"rank {self.rank} was given to {plan.members.get(self.rank)} in epoch "
                                 f"{plan.epoch}: this worker was declared failed")
        new_member = self._needs_state
        if plan.epoch > 0:
            for wrapper in self._ddps:
                wrapper.release()
            for index, wrapper in enumerate(self._ddps):
                if not self._needs_state:
                    self.kv.compare_set(f"epoch/{plan.epoch}/ddp/{index}", b"",
                                        json.dumps(wrapper.bucket_layout()).encode())
            self.groups.destroy()
            with self._epoch_lock:  # see _on_new_epoch
                for replication in (self.replication, *self.shared_replication):
                    replication.reset()
                self.epoch = plan.epoch
            self._pending_replication = None
            if not self._needs_state:
                self._mark("abort")
        self.epoch = plan.epoch
        # The version in flight counts as held: a local copy does not fail short of a
        # bug, and waiting for it here would put it on every recovery's critical path.
        # It is waited for below only if it is the recovery point.
        local = set.intersection(*({*store.committed_versions(), store.in_flight_version()} - {None}
                                   for store in self._stores()))
        own_share = self.shares.share_of(self.rank)
        shared_regions = {v: self.shared[own_share].region_address(v) for v in local} if self._data_parallel else {}
        self.kv.set(f"epoch/{plan.epoch}/report/{self.rank}", MemberReport(
            self.rank, self.worker, sorted(local), self.replication.held_versions(), self.replication.address,
            self._needs_state, self.shared_replication[own_share].address, os.getpid(), shared_regions).encode())
        reports = self._gather_reports(plan.epoch)
        self.replication.connect({r: report.address for r, report in reports.items()})
        for replication in self.shared_replication:  # every rank's server is the one of its own share
            replication.connect({r: report.shared_address for r, report in reports.items()})
        restore = None
        if plan.epoch > 0:
            version, lost = recovery_point(reports, self.placement, self.shares if self._data_parallel else None)
            if version is None:
                restore = self._fall_back_to_checkpoint(plan, lost, reports)
            else:
                self.replication.drop_newer(version)
                restore = ("pull", version, (sources_of(self.rank, version, reports, self.placement),
                                             self._share_pulls(version, reports)))
            self.next_step = restore[1] + 1
            self._first_step_after = self.next_step
        # Rolling back from memory overlaps the re-forming of the group: both take tens
        # of milliseconds, and neither needs the other.
        rolling = None
        if restore is not None and restore[0] == "pull" and (self._registered or not self._needs_state):
            rolling = _Background(self._roll_back, restore)
        try:
            self.groups.form(self.kv.torch_store, plan.epoch, self.rank, self.world_size, self.join_timeout)
            self._check_current(plan.epoch)
        except (AbortedError, _Superseded):
            if rolling is not None:
                rolling.join(check=False)
            raise _Superseded() from None
        self._mark("re-form")
        self.events.write("joined", epoch=plan.epoch, rank=self.rank)
        if plan.epoch == 0:
            return
        self.recoveries += 1
        if rolling is not None:
            try:
                rolling.join()
            except Exception:  # noqa: BLE001 - a pull from a member that died meanwhile
                if not self._failure_declared(plan.epoch):
                    raise
                raise _Superseded() from None
        elif not self._needs_state or self._registered:
            self._roll_back(restore)
        else:
            self._pending_restore = restore  # track() restores once the state is registered
        if new_member:
            # Off the critical path: the first push to this holder comes a step later
            # (if it came sooner, it would fail and the next round would carry it).
            self._reserve_replicas(background=True)
            return
        for wrapper in self._ddps:
            wrapper.rebuild(init_sync=False, layout=wrapper.bucket_layout())
        _reset_fsdp(self._tracked.get("model"))

    def _share_pulls(self, version: int, reports: Mapping[int, MemberReport]) -> Dict[int, Tuple[List[int], Any]]:
        """share -> (its sources, those on this node with their regions) for each
        data-parallel share this rank must pull to be at ``version``: every share for
        a rank that needs state, else all but its own."""
        if not self._data_parallel:
            return {}
        pulls = {}
        for share in range(self.shares.count):
            if share == self.shares.share_of(self.rank) and not self._needs_state:
                continue
            sources = share_sources(share, version, reports, self.shares)
            pulls[share] = (sources, same_node_regions(self.worker, version, sources, reports))
        return pulls

    def _pull_shares(self, version: int, pulls: Mapping[int, Tuple[List[int], Any]]) -> None:
        """Pull ``version`` of the data-parallel shares in ``pulls`` (see _share_pulls), all
        at once, so that a share read from a node-mate's memory overlaps one coming
        over the network. (On the 2 busy cores of the benches this measured no faster
        than one after the other: nothing was idle to overlap.)"""
        def pull(share: int) -> None:
            sources, regions = pulls[share]
            self.shared_replication[share].pull(self.rank, version, sources=sources, same_machine=regions)

        shares = sorted(pulls)
        threads = [_Background(pull, share, name=f"peerstate-pull-share-{share}") for share in shares]
        for thread in threads:
            thread.join(check=False)
        for thread in threads:
            thread.join()  # the first error, once none is left running
        if shares:  # logged after the first step
            totals = {key: sum(self.shared_replication[s].last_pull[key] for s in shares)
                      for key in ("chunks", "chunks_from_memory")}
            self._pulled = dict(rank=self.rank, version=version, replacement=self._needs_state, shares=shares,
                                same_node_sources=sorted({s for share in shares for s in pulls[share][1]}), **totals)

    def _roll_back(self, restore: Tuple[str, int, Any]) -> None:
        """Bring the registered state back to the recovery point."""
        kind, version, where = restore
        if self._needs_state:
            self._pending_restore = restore
            self._restore_pending()
        elif kind == "checkpoint":
            self._load_checkpoint(where, version)
            self._mark("restore")
        else:
            self._pull_shares(version, where[1])
            self._restore_stores(version, pulled_shares=set(where[1]))
            self._mark("restore")

    def _restore_stores(self, version: int, pulled_shares: Container[int] = (), pulled_own: bool = False) -> None:
        """Restore ``version`` from every store, the data-parallel shares first: their
        objects (scheduler) are applied before this rank's own (RNG). A newer version
        in flight is cancelled; ``version`` itself, if in flight, is waited for.
        What was just pulled (``pulled_shares``, and this rank's own state with
        ``pulled_own``) skips the checksum pass: every chunk was verified as it arrived."""
        shares = [(store, share in pulled_shares) for share, store in enumerate(self.shared)]
        for store, pulled in (shares if self._data_parallel else []) + [(self.snapshots, pulled_own)]:
            if store.in_flight_version() == version:
                store.wait()
            store.restore(version, verify=not pulled)

    def _gather_reports(self, epoch: int) -> Dict[int, MemberReport]:
        keys = [f"epoch/{epoch}/report/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.join_timeout
        while True:
            self._check_current(epoch)
            try:
                self.kv.wait(keys, timeout=0.5)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    missing = [r for r, raw in zip(range(self.world_size), self.kv.get_many(keys)) if raw is None]
                    raise JobFailedError(f"ranks {missing} did not join epoch {epoch} within "
                                         f"{self.join_timeout:.0f}s") from None
        return {r: MemberReport.decode(raw) for r, raw in enumerate(self.kv.get_many(keys))}

    def _failure_declared(self, epoch: int) -> bool:
        """After an error in the loop: wait for the coordinator to declare a failure
        (a plan for a newer epoch). Up to ``failure_grace`` seconds, and for as long
        as a plan is being written (its writer may be waiting for a spare)."""
        if self.watcher.wait_newer(epoch, self.failure_grace):
            return True
        deadline = time.monotonic() + self.join_timeout
        while self.kv.get(f"epoch/{epoch + 1}/owner") is not None and time.monotonic() < deadline:
            if self.watcher.wait_newer(epoch, 1.0):
                return True
            if self.coordinator.failure():
                return False
        return False

    def _check_current(self, epoch: int) -> None:
        if self.watcher.latest.epoch > epoch:
            raise _Superseded()
        failure = self.coordinator.failure()
        if failure:
            raise JobFailedError(f"the job stopped: {failure}")

    def _fall_back_to_checkpoint(self, plan: RecoveryPlan, lost: Dict[int, str],
                                 reports: Mapping[int, MemberReport]) -> Tuple[str, int, str]:
        ranks = sorted(r for r in lost if r >= 0) or plan.failed
        message = f"rank{'s' if len(ranks) > 1 else ''} {' and '.join(map(str, ranks))} lost; " + "; ".join(lost.values())
        checkpoint = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
        if checkpoint is None:
            reason = f"{message}. No disk checkpoint is configured (--checkpoint-dir), so the job stops."
            self.coordinator.fail_job(reason)
            held = {r: {"local": report.local, "replicas": report.replicas, "needs_state": report.needs_state}
                    for r, report in reports.items()}
            self.events.write("state_lost", epoch=plan.epoch, message=reason, held=held)
            raise StateLostError(reason)
        step, path = checkpoint
        self.events.write("checkpoint_fallback", epoch=plan.epoch, message=message, step=step, path=path)
        print(f"peerstate: {message}; falling back to the disk checkpoint of step {step} ({path})",
              file=sys.stderr, flush=True)
        return ("checkpoint", step, path)

    def _restore_pending(self) -> None:
        kind, version, where = self._pending_restore
        if kind == "checkpoint":
            self._load_checkpoint(where, version)
            self._mark("transfer")
        else:
            own_sources, share_pulls = where
            self.replication.pull(self.rank, version, sources=own_sources)
            self._pull_shares(version, share_pulls)
            self._mark("transfer")
            self._restore_stores(version, pulled_shares=share_pulls, pulled_own=True)
        self._mark("restore")
        self._pending_restore = None
        self._needs_state = False

    # -- step boundaries ------------------------------------------------------------
    def _end_step(self, step: int, seconds: float) -> None:
        if self._first_step_after == step:
            self._mark("first step")  # the step itself is done; what follows is bookkeeping
        if self.progress:
            self.progress.set_step(step)
        if not self._registered:
            self._register()
            self.kv.set(f"bytes/{self.rank}", str(self.snapshots.memory()["bytes_per_version"]).encode())
            self._reserve_replicas()
        if self.capture and step % self.snapshot_every == 0:
            self._start_replication()  # no optimizer hook ran (no optimizer tracked)
            for store in self._stores():
                store.snapshot(step)
            self._pending_replication = step
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            self._save_checkpoint(step)
        if self._first_step_after == step:
            self._first_step_after = None
            self._publish_marks()
        else:
            self._step_seconds.append(seconds)
        if not self._start_recorded:  # the job's wall clock starts with its first step
            self.kv.compare_set("job/started", b"", str(time.time() - seconds).encode())
            self._start_recorded = True

    def _start_replication(self) -> None:
        """Before optimizer.step(): the snapshot of the last version must be complete
        (it reads the live tensors); then stream it to the buddies in the background."""
        version, self._pending_replication = self._pending_replication, None
        if version is not None:
            for store in self._stores():
                store.wait()
            self._report_failed_round()
            self.replication.replicate(version)  # data-parallel state has no buddies: nothing to send

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
                self.events.write("replication_failed" if failing else "replication_resumed", rank=self.rank,
                                  holder=holder, version=version, error=failing)
                if failing:
                    print(f"peerstate: rank {self.rank}: version {version} did not reach its holder rank {holder} "
                          f"({failing}); retrying with the next step's version", file=sys.stderr, flush=True)

    def _register(self) -> None:
        """Register the tracked state with the SnapshotStores and allocate their versions."""
        tracked = self._tracked
        tensors, objects = training_state(tracked.get("model"), tracked.get("optimizer"))
        if tracked.get("scheduler") is not None:
            objects["scheduler"] = (tracked["scheduler"].state_dict, tracked["scheduler"].load_state_dict)
        if self._data_parallel:
            self._create_share_stores()
            self._register_shares(tensors, objects)
        else:
            self.snapshots.register_many(tensors)
            for name, (get, set_) in objects.items():
                self.snapshots.register_object(name, get, set_)
        private = {"loader": tracked.get("loader"), **{f"extras/{n}": v for n, v in tracked.get("extras", {}).items()}}
        for name, obj in private.items():
            if obj is not None:
                self.snapshots.register_object(name, obj.state_dict, obj.load_state_dict)
        self.snapshots.register_object("rng", _rng_state, _set_rng_state)
        for store in self._all_stores():
            store.allocate()
        self._registered = True

    def _create_share_stores(self) -> None:
        """One store per data-parallel share. This rank snapshots its own share into
        ``versions`` slots; the others only receive the shares it pulls at a recovery,
        into two. A spare registers before it knows its share: all get ``versions``."""
        if self.shared:
            return
        own = None if self.rank is None else self.shares.share_of(self.rank)
        self.shared = [SnapshotStore(max_versions=self._versions if own in (None, share) else 2,
                                     threads=self._snapshot_threads) for share in range(self.shares.count)]

    def _register_shares(self, tensors: Mapping[str, Any], objects: Mapping[str, Tuple[Callable, Callable]]) -> None:
        """Cut the data-parallel state into the share stores (the same cut on every
        rank; a tensor across a cut is registered as two byte ranges); its Python
        state goes with the lightest share."""
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        load = [0] * self.shares.count
        for (name, tensor), size, pieces in zip(tensors.items(), sizes, self.shares.split(sizes)):
            for share, start, end in pieces:
                if (start, end) == (0, size):
                    self.shared[share].register(name, tensor)
                else:
                    self.shared[share].register(f"{name}[{start}:{end}]", ByteRange(tensor, start, end - start))
                load[share] += end - start
        lightest = self.shared[load.index(min(load))]
        for name, (get, set_) in objects.items():
            lightest.register_object(name, get, set_)
        empty = [share for share, store in enumerate(self.shared) if not store.registered()]
        if empty:
            raise InvalidArgumentError(f"data-parallel shares {empty} would be empty: the tracked state has "
                                       f"{sum(sizes)} bytes for {self.shares.count} shares; pass "
                                       "Job(data_parallel_shares=...) a smaller count")

    def _stores(self) -> List[SnapshotStore]:
        """The stores this rank snapshots: its own, then its share of the data-parallel state."""
        if not self._data_parallel:
            return [self.snapshots]
        return [self.snapshots, self.shared[self.shares.share_of(self.rank)]]

    def _all_stores(self) -> List[SnapshotStore]:
        """Every store holding tracked state: this rank's own, then each data-parallel share."""
        return [self.snapshots, *self.shared] if self._data_parallel else [self.snapshots]

    def _reserve_replicas(self, background: bool = False) -> None:
        """Account (and allocate) the replicas of the ranks this rank serves."""
        served = self.placement.served_by(self.rank)
        self.kv.wait([f"bytes/{r}" for r in served], timeout=self.join_timeout)
        sizes = {r: int(self.kv.get(f"bytes/{r}")) for r in served}
        if background:
            threading.Thread(target=self.replication.reserve, args=(sizes,), name="peerstate-reserve",
                             daemon=True).start()
        else:
            self.replication.reserve(sizes)

    # -- disk checkpoints (the fallback when every copy is lost) --------------------
    def _checkpoint_state(self) -> Dict[str, Any]:
        """What a disk checkpoint holds, keyed the same whatever the data-parallel
        shares: this rank's own tensors and objects, then the whole data-parallel
        tensors and the objects of every share."""
        import torch

        own = {name: owner for name, owner in self.snapshots.owners().items() if isinstance(owner, torch.Tensor)}
        state: Dict[str, Any] = {f"rank{self.rank}/own/{name}": t for name, t in own.items()}
        state[f"rank{self.rank}/own/objects"] = self.snapshots.capture_objects()
        if self._data_parallel:
            tensors, _ = training_state(self._tracked.get("model"), self._tracked.get("optimizer"))
            state.update({f"rank{self.rank}/data_parallel/{name}": t for name, t in tensors.items()})
            state[f"rank{self.rank}/data_parallel/objects"] = {
                name: value for store in self.shared for name, value in store.capture_objects().items()}
        return state

    def _save_checkpoint(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        for store in self._all_stores():
            store.wait()
        dcp.save(self._checkpoint_state(), checkpoint_id=os.path.join(self.checkpoint_dir, f"step_{step:09d}"))

    def _load_checkpoint(self, path: str, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        for store in self._all_stores():
            part = "own" if store is self.snapshots else "data_parallel"
            store.apply_objects(state[f"rank{self.rank}/{part}/objects"])
            store.drop_newer(step)  # the next snapshot is step + 1

    # -- accounting -----------------------------------------------------------------
    def _mark(self, phase: str) -> None:
        self._marks[phase] = time.time()

    def _publish_marks(self) -> None:
        if self._pulled is not None:
            self.events.write("pulled", **self._pulled)
            self._pulled = None
        epoch = self.epoch
        self.kv.set(f"epoch/{epoch}/marks/{self.rank}", json.dumps(self._marks).encode())
        if self.kv.add(f"epoch/{epoch}/marks_done", 1) != self.world_size:
            return
        plan = self.coordinator.plan(epoch)
        raw = self.kv.get_many([f"epoch/{epoch}/marks/{r}" for r in range(self.world_size)])
        marks = {r: json.loads(m) for r, m in enumerate(raw) if m}
        fault = _fault_time(self._env.events, plan)
        timeline = recovery_timeline(plan.__dict__, marks.values(), fault)
        self.events.write("recovery", **timeline, marks=marks, version=self.next_step - 1)
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in timeline["phases_s"].items() if v is not None)
        print(f"peerstate: recovered epoch {epoch} (ranks {plan.failed}) in {timeline['total_s']:.2f}s "
              f"from {timeline['from']}: {phases}", file=sys.stderr, flush=True)

    def _finish(self, total: int) -> None:
        self._loop_done = True
        self._start_replication()
        if self.replication.replicator.in_flight_version() is not None:
            self.replication.wait(self.replication.replicator.in_flight_version(), check=False)
        if self.kv.add("job/finished", 1) == self.world_size:
            started = float(self.kv.get("job/started") or time.time())
            wall = time.time() - started
            step_s = statistics.median(self._step_seconds) if self._step_seconds else 0.0
            goodput = min(1.0, total * step_s / wall) if wall > 0 else 0.0
            self.events.write("job_end", steps=total, wall_s=wall, median_step_s=step_s, goodput=goodput,
                              recoveries=self.epoch)
            print(f"peerstate: job finished {total} steps in {wall:.2f}s through {self.epoch} recoveries; "
                  f"goodput {goodput:.1%}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop watching, serving and snapshotting (call once the loop is done)."""
        if self._closed:
            return
        self._closed = True
        if self.progress:
            self.progress.finish()  # shutting down takes a while: not a hang
        if self.watcher is not None:
            self.watcher.stop()
        for replication in (self.replication, *self.shared_replication):
            if replication is not None:
                replication.close()
        for wrapper in self._ddps:
            wrapper.release()
        self.groups.destroy()
        for store in (self.snapshots, *self.shared):
            store.close()
        if self.progress:
            self.progress.close()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Background(threading.Thread):
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


class _Guard:
    def __init__(self, job: Job) -> None:
        self.job = job

    def __enter__(self) -> None:
        self.job._guarded = True
        self.started = time.monotonic()

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool:
        job = self.job
        step = job.next_step
        epoch = job.epoch
        if exc_type is None and job.watcher.latest.epoch == epoch:
            try:
                job._end_step(step, time.monotonic() - self.started)
                job.next_step = step + 1
                return False
            except Exception:  # noqa: BLE001 - a failure during the boundary is a failure too
                if not job._failure_declared(epoch):
                    raise
        elif exc_type is not None:
            if not issubclass(exc_type, Exception):
                return False  # KeyboardInterrupt, SystemExit
            if not job._failure_declared(epoch):
                return False  # no failure was declared: a genuine error in the loop
        job.events.write("step_interrupted", step=step, epoch=epoch,
                         error=f"{exc_type.__name__}: {str(exc)[:200]}" if exc_type else None)
        job._needs_recovery = True
        return True


def latest_checkpoint(directory: str) -> Optional[Tuple[int, str]]:
    """(step, path) of the newest complete checkpoint in ``directory`` (DCP writes
    .metadata last, so a directory without it is incomplete)."""
    if not directory or not os.path.isdir(directory):
        return None
    done = [name for name in os.listdir(directory)
            if name.startswith("step_") and os.path.exists(os.path.join(directory, name, ".metadata"))]
    if not done:
        return None
    newest = max(done)
    return int(newest[5:]), os.path.join(directory, newest)


def _fault_time(events_path: Optional[str], plan: RecoveryPlan) -> Optional[float]:
    """When the fault this plan answers was injected, if the injector logged it."""
    if not events_path or not os.path.exists(events_path):
        return None
    faults = [e["time"] for e in read_events(events_path)
              if e["event"] == "fault_injected" and plan.detected_at - 60 < e["time"] <= plan.detected_at]
    return max(faults) if faults else None


def _reset_fsdp(model: Any) -> None:
    """After an abort, FSDP2 (``fully_shard``) modules: drop the aborted iteration
    (``reset_iter_state``: in-flight collectives, unsharded parameters, per-iteration
    trackers) and point their cached process groups at the re-formed world group.
    Their device mesh finds groups by name, and the re-formed group has the old one's."""
    if model is None or not hasattr(model, "reset_iter_state"):
        return
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
        for info in (group.mesh_info, group.post_forward_mesh_info) if group is not None else ():
            if info is not None and getattr(info, "shard_mesh_dim", None) is not None:
                info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
    try:
        model.reset_iter_state()
    except Exception:  # noqa: BLE001 - it waits on the aborted iteration's collectives, which
        model.reset_iter_state()  # failed; the first call cleared them, the second finishes the reset


def _warm_up() -> None:
    """What a spare does while it waits: import what the first optimizer (torch._dynamo,
    about a second), DDP and checkpointing import lazily, so a replacement starts warm."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.nn.parallel  # noqa: F401


def _rng_state() -> Dict[str, Any]:
    """The RNG states, pickled every step: torch's as bytes, since a tensor pickles
    through torch.save (~15x slower for these 5 KB)."""
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    import torch

    def tensor(raw: bytes) -> Any:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    random.setstate(state["python"])
    torch.set_rng_state(tensor(state["torch"]))
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])

"""A large job simulated over a real store: what ``bench/scale.py`` measures and
the protocol tests drive.

A ``SimulatedNode`` runs its agent's real control code (``NodeControl``, and
through it ``NodeRelay``, ``InstructionWriter``, ``Coordinator``) against the
job's real store, over connections of its own, exactly as ``peerstate run``'s
agent does. Its ``SimulatedMembers`` make the job-store requests its workers
make in a recovery, with the workers' own code (``DistributedWrappers``,
``reserve_replicas``, ``publish_size``, ``RecoveryReport``), and the requests
torch's ``ProcessGroupNCCL`` makes to form the epoch's communicator
(``NcclRendezvous``), through the store a worker hands torch (its reads made
once per node, ``control.node_rendezvous``) and torch's own TCPStore client.
What is modelled, not run:
- the node channel is an in-process store (``SimulatedChannel``), and the
  members on it answer at once: when the relay copies a plan into it, each
  member of the node writes the report a worker writes (what it holds if it
  snapshotted every step up to ``version``); a worker's abort, its step and
  its restore are not run, and its first step after the recovery ends as soon
  as its groups are ready;
- the job is data-parallel with one DDP wrapper (``_BucketLayout`` stands in
  for it: a layout, no model);
- a node's members share one connection to the job's store and one to the
  rendezvous, and take turns on a thread (a node's 8 processes have 16): the
  requests and bytes are a real node's, the connections an eighth;
- the communicator's own initialisation (NCCL's bootstrap ring and transport
  setup, on the GPUs' network) is not run: ``tools/goodput`` models it.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from peerstate.control import keys
from peerstate.control.stores import open_store
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.control.messages import MemberReport, RecoveryPlan, StateLayout
from peerstate.control.node_control import NodeControl
from peerstate.control.node_rendezvous import node_rendezvous_store
from peerstate.control.planning import node_of_worker
from peerstate.control.timeline import EventLog
from peerstate.replication.worker_keys import WorkerKeys
from peerstate.replication.placement import BuddyPlacement
from peerstate.worker.rebuild import DistributedWrappers
from peerstate.worker.report import RecoveryReport
from peerstate.worker.step_boundary import publish_size, reserve_replicas

SIMULATED_SECRET = b"the simulated job's secret: 32 b"

LAYOUT = StateLayout(k=1, share_count=8, data_parallel=True)  # the default of a multi-node job of 8 ranks per node


def buddy_placement(world_size: int, nproc: int, k: int) -> BuddyPlacement:
    """The placement of a job of ``world_size`` ranks, ``nproc`` per node, ``k`` copies."""
    return BuddyPlacement([r // nproc for r in range(world_size)], k=k)


def served_by(world_size: int, nproc: int, k: int, placement: Optional[BuddyPlacement] = None) -> Dict[int, List[int]]:
    """holder -> the ranks whose snapshots it keeps (``BuddyPlacement``, inverted once)."""
    placement = placement or buddy_placement(world_size, nproc, k)
    served: Dict[int, List[int]] = {r: [] for r in range(world_size)}
    for rank in range(world_size):
        for holder in placement.holders(rank):
            served[holder].append(rank)
    return served


class SimulatedChannel(InMemoryKeyValueStore):
    """A node channel whose members answer a plan at once with their reports, and
    that notes when each epoch's instructions reached them (each member's
    expansion of its part, ``planning.expand`` in its own process, is not run)."""

    def __init__(self, node: int, nproc: int, served: Dict[int, List[int]], version: int,
                 layout: StateLayout = LAYOUT) -> None:
        super().__init__()
        self.node = node
        self.members = {node * nproc + k: f"n{node}.{k}" for k in range(nproc)}  # rank -> worker, this node's
        self._served = served
        self._version = version
        self._layout = layout
        self._fresh: set = set()  # ranks whose worker joined and has not been told how to restore yet
        self.delivered: Dict[int, float] = {}  # epoch -> when its instructions reached the members
        # Called with each plan and the ranks that have just joined, before the members report:
        # what the workers do at an abort (``SimulatedMembers.abort``).
        self.on_plan: Optional[Callable[[RecoveryPlan, set], None]] = None
        self._encoded: Dict[tuple, bytes] = {}
        self._delivery = threading.Condition()

    def set_many(self, items: Sequence[Tuple[str, bytes]]) -> None:
        super().set_many(items)
        plans = [RecoveryPlan.decode(v) for k, v in items if k.endswith("/plan")]
        for plan in plans:
            self._answer(plan)
        orders = {int(k.split("/")[1]) for k, _ in items if "/orders/" in k}
        if orders:
            self._fresh = set()  # told how to restore: from now on they hold state
            with self._delivery:
                for epoch in orders:
                    self.delivered[epoch] = time.time()
                self._delivery.notify_all()

    def _answer(self, plan: RecoveryPlan) -> None:
        for rank, worker in plan.replaced.items():
            if node_of_worker(worker) == self.node:
                if self.get(keys.rank_certificate(worker, rank)) is None:  # what the spare reads first
                    raise RuntimeError(f"{worker} was given rank {rank} without its certificate")
                self.members[rank] = worker
                self._fresh.add(rank)
            else:
                self.members.pop(rank, None)
        if self.on_plan is not None:
            self.on_plan(plan, set(self._fresh))
        for rank, worker in self.members.items():
            if (rank, worker, rank in self._fresh) not in self._encoded:  # a member's report changes when it does
                self._encoded[(rank, worker, rank in self._fresh)] = self.report(rank, worker).encode()
            self.set(keys.member_report(plan.epoch, rank), self._encoded[(rank, worker, rank in self._fresh)])

    def report(self, rank: int, worker: str) -> MemberReport:
        """What ``rank``'s worker holds at ``version`` (nothing if it just joined)."""
        if rank in self._fresh:
            return MemberReport(rank, worker, [], {}, ("127.0.0.1", 20000 + rank % 40000), True, os.getpid(),
                                layout=self._layout)
        versions = [self._version - 1, self._version]
        regions = {v: 0x10000 * (v + 1) for v in versions} if self._layout.data_parallel else {}
        return MemberReport(rank, worker, versions, {s: list(versions) for s in self._served[rank]},
                            ("127.0.0.1", 20000 + rank % 40000), False, os.getpid(), regions, None, self._layout)

    def wait_delivered(self, epoch: int, timeout: float) -> float:
        """When epoch ``epoch``'s instructions reached this node's members."""
        with self._delivery:
            if not self._delivery.wait_for(lambda: epoch in self.delivered, timeout):
                raise TimeoutError(f"node {self.node} got no instructions for epoch {epoch} within {timeout:.0f}s")
            return self.delivered[epoch]


class SimulatedNode:
    """One node's agent, as far as the job's store sees it (see the module docstring):
    the agent's own ``NodeControl`` on a simulated channel."""

    def __init__(self, store: str, node: int, nnodes: int, nproc: int, served: Dict[int, List[int]], *,
                 spares: int = 1, version: int = 100, report_timeout: float = 60.0, lease_timeout: float = 3.0,
                 layout: StateLayout = LAYOUT, placement: Optional[BuddyPlacement] = None) -> None:
        self.node, self.nnodes, self.nproc, self.spares = node, nnodes, nproc, spares
        self.kv = open_store(store, timeout=120.0)  # HOST:PORT of a TCPStore, or etcd://...
        self.channel = SimulatedChannel(node, nproc, served, version, layout)
        # With a placement, the node's workers too (their requests to the job's store).
        self.members = SimulatedMembers(store, self.channel, nnodes * nproc, placement, report_timeout) \
            if placement is not None else None
        self.failures: List[str] = []
        self.fenced = False
        # The relay's connection is a clone: one count for both, as in the agent.
        self.control = NodeControl(self.kv, node, nnodes, nproc, join_timeout=report_timeout,
                                   lease_timeout=lease_timeout, spare_timeout=report_timeout,
                                   on_failure=self.failures.append, on_fenced=self._on_fenced,
                                   say=lambda message: None)
        self.coordinator, self.writer, self.leases = self.control.coordinator, self.control.writer, self.control.leases
        self.keys = WorkerKeys(SIMULATED_SECRET)  # the relay certifies a spare a plan takes, as the agent's
        self._began = False

    @property
    def relay(self):
        return self.control.relay

    def connect(self) -> None:
        """What the agent does when it starts, up to waiting for the other nodes (which a
        simulation starts one by one): agree on the shape, count in; its spares register."""
        self.control.count_in()
        for index in range(self.spares):
            spare = f"n{self.node}.{self.nproc + index}"
            self.keys.new_worker(spare, None)
            self.coordinator.register_spare(spare)

    def start(self) -> None:
        """The rest of the agent's start: epoch 0, then the relay (again, after ``stop``:
        an agent that stalled and came back). Not its wait for every node to count in:
        the harness starts the nodes when it wants them to run."""
        if not self._began:
            self.control.begin()
            self._began = True
        self.control.start_relay(self.channel, certify=self.keys.certify)

    def _on_fenced(self) -> None:
        self.fenced = True

    def tick(self, now: float) -> None:
        """One agent watch tick's store calls in the steady state (``Agent._watch``)."""
        self.control.tick([f"n{self.node}.{self.nproc + i}" for i in range(self.spares)])
        self.control.check_leases(now)

    def stop(self, wait: bool = True) -> None:
        """Stop the relay; ``wait=False`` only asks it to (stop many, then wait for each)."""
        self.control.stop_relay(wait)


# TORCH_NCCL_RANKS_PER_ROOT's default: above it, ProcessGroupNCCL forms a communicator from
# several unique ids (ncclCommInitRankScalable, NCCL 2.23+), one per this many ranks.
RANKS_PER_ROOT = 128
NCCL_UNIQUE_ID_BYTES = 128


class NcclRendezvous:
    """The store requests torch's ``ProcessGroupNCCL`` makes to form one communicator
    (the default group of an epoch, ``ProcessGroups.form``), made through ``store``,
    the store a worker hands torch (``control.node_rendezvous``: a node reads each
    set of ids once; ``count`` is what it sent to the job's store). After
    ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`` (torch 2.6 and later, built
    with NCCL 2.23 or later, as 2.13's wheels are):
    - up to ``RANKS_PER_ROOT`` ranks, ``broadcastUniqueNCCLID``: rank 0 sets the
      unique id, every other rank gets it;
    - above, ``allgatherUniqueNCCLIDs``: one root per ``RANKS_PER_ROOT`` ranks sets
      its id, and every rank reads all of them (``multiGet``).
    ``init_process_group`` adds no store barrier unless ``TORCH_DIST_INIT_BARRIER=1``.
    gloo's rendezvous (every rank reads every other's address: N^2 reads) is not
    made here: it serves CPU jobs, not jobs of thousands of ranks."""

    def __init__(self, store) -> None:
        self.store = store
        self.count = store.count
        self._ids: Tuple[Tuple[int, int], List[str]] = ((-1, 0), [])

    def announce(self, epoch: int, rank: int, world_size: int) -> None:
        """A root rank's part: publish its unique id (nothing for the others)."""
        name = self._root_key(rank, world_size)
        if name is not None:
            self.store.set(self._key(epoch, name), os.urandom(NCCL_UNIQUE_ID_BYTES))

    def join(self, epoch: int, rank: int, world_size: int) -> None:
        """Every other rank's part: wait for and read the ids it needs (blocks until the
        roots announced them, or the store's timeout)."""
        roots = math.ceil(world_size / RANKS_PER_ROOT)
        if roots == 1:
            if rank != 0:
                self.store.get(self._key(epoch, "0"))
            return
        if self._ids[0] != (epoch, roots):  # the names, once (torch makes them in C++)
            base = self._key(epoch, "UniqueNCCLID:")
            self._ids = ((epoch, roots), [f"{base}{r}" for r in range(roots)])
        self.store.multi_get(self._ids[1])

    def form(self, epoch: int, rank: int, world_size: int) -> None:
        """One rank's whole rendezvous."""
        self.announce(epoch, rank, world_size)
        self.join(epoch, rank, world_size)

    @staticmethod
    def _key(epoch: int, name: str) -> str:
        """The key torch's PrefixStores make of ``name``: the epoch's (``ProcessGroups.form``), the
        default group's ("0"), its device's. The store is called with it directly, as the innermost
        PrefixStore calls it: the same store code, without a crossing from C++ back into Python per
        call, which a process packed with a hundred nodes' threads pays for in interpreter-lock waits."""
        return f"{keys.process_group_prefix(epoch)}/0//cuda//{name}"

    @staticmethod
    def _root_key(rank: int, world_size: int) -> Optional[str]:
        roots = math.ceil(world_size / RANKS_PER_ROOT)
        if roots == 1:
            return "0" if rank == 0 else None
        index = _roots(world_size, roots).get(rank)
        return None if index is None else f"UniqueNCCLID:{index}"


@functools.lru_cache(maxsize=4)
def _roots(world_size: int, roots: int) -> Dict[int, int]:
    """rank -> its index among the roots, spread evenly over the ranks."""
    return {r * world_size // roots: r for r in range(roots)}


class _BucketLayout:
    """What ``DistributedWrappers`` asks of a DDP wrapper in a recovery: its bucket
    layout (a model of two buckets), and its release."""

    def release(self) -> None:
        pass

    def bucket_layout(self) -> List[List[int]]:
        return [[3, 2], [1, 0]]


class _Reservations:
    """Where ``reserve_replicas`` reserves the replicas a rank will hold (the
    replication endpoint's ``reserve``): noted, not allocated."""

    def __init__(self) -> None:
        self.sizes: Dict[int, int] = {}

    def reserve(self, sizes: Dict[int, int]) -> None:
        self.sizes.update(sizes)


class SimulatedMembers:
    """One node's workers, as far as the job's store sees them in a recovery (see the
    module docstring). ``abort`` runs on each plan, before the members report;
    ``run`` then waits for the node's instructions, forms the epoch's group, makes a
    replacement's requests, and ends each member's first step after the recovery,
    which puts its marks in the node channel (its agent forwards them)."""

    def __init__(self, store: str, channel: SimulatedChannel, world_size: int, placement: BuddyPlacement,
                 timeout: float, state_bytes: int = 1 << 30) -> None:
        self.kv = open_store(store, timeout=timeout)
        self.rendezvous = NcclRendezvous(node_rendezvous_store(self.kv.rendezvous_store(), channel, timeout))
        self.channel, self.world_size, self.placement, self.timeout = channel, world_size, placement, timeout
        self.state_bytes = state_bytes
        self.ready: Dict[int, float] = {}  # epoch -> when every member's group was formed
        self._wrappers: Dict[int, DistributedWrappers] = {}
        self._reports: Dict[int, RecoveryReport] = {}
        self._fresh: Dict[int, set] = {}
        for rank in channel.members:
            self._wrappers[rank], self._reports[rank] = self._member(rank, started=True)
        channel.on_plan = self.abort

    def _member(self, rank: int, started: bool) -> Tuple[DistributedWrappers, RecoveryReport]:
        wrappers = DistributedWrappers(self.kv)
        if started:
            wrappers.ddps.append(_BucketLayout())
        report = RecoveryReport(self.kv, self.channel, EventLog(None, f"rank{rank}"), self.world_size)
        report._start_recorded = started  # a new process records the job's start at its first step
        return wrappers, report

    def abort(self, plan: RecoveryPlan, fresh: set) -> None:
        """What each worker does when the plan reaches it (``EpochJoiner.join``): it
        drops its DDP wrappers; a replacement starts."""
        if plan.epoch == 0:
            return  # the job's start: no recovery
        self._fresh[plan.epoch] = fresh
        for rank in self.channel.members:
            if rank in fresh:
                self._wrappers[rank], self._reports[rank] = self._member(rank, started=False)
            report = self._reports[rank]
            report.recovery_began()
            self._wrappers[rank].release()
            if rank not in fresh:
                report.mark("abort")

    def run(self, epoch: int, version: int) -> None:
        """The node's members through epoch ``epoch``'s recovery, up to their first step's end."""
        self.channel.wait_delivered(epoch, self.timeout)
        fresh = self._fresh.get(epoch, set())
        kept = [rank for rank in self.channel.members if rank not in fresh]
        for rank in kept:  # with its instructions (EpochJoiner.join)
            self._wrappers[rank].publish_layouts(epoch, rank, kept)
        for rank in self.channel.members:  # the roots first: one thread takes the node's members in turn
            self.rendezvous.announce(epoch, rank, self.world_size)
        for rank in self.channel.members:
            self.rendezvous.join(epoch, rank, self.world_size)
            self._reports[rank].mark("re-form")
            if rank in fresh:  # after its restore: the script wraps its model (Job.ddp), reserves replicas
                self._wrappers[rank].published_layout(epoch, 0, self.timeout)
                reserve_replicas(self.kv, _Reservations(), self.placement, rank, self.timeout)
        self.ready[epoch] = time.time()
        for rank in self.channel.members:
            report = self._reports[rank]
            if rank in fresh:  # its first boundary registers its state
                publish_size(self.kv, rank, self.state_bytes)
            report.mark("first step")
            report.first_step_after = version + 1
            report.end_step(version + 1, 0.0, epoch, rank)

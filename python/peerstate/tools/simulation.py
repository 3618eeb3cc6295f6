"""The control plane of a large job, simulated over a real store: what
``bench/scale.py`` measures and the protocol tests drive.

A ``SimulatedNode`` runs its agent's real control code (``NodeControl``, and
through it ``NodeRelay``, ``InstructionWriter``, ``Coordinator``) against the
job's real store, over connections of its own, exactly as ``peerstate run``'s
agent does. What is
modelled, not run:
- the node channel is an in-process store (``SimulatedChannel``), and the
  members on it answer at once: when the relay copies a plan into it, each
  member of the node writes the report a worker writes (what it holds if it
  snapshotted every step up to ``version``); a worker's abort, its step and
  its restore are not run;
- process groups are not formed (that is torch's rendezvous, not ours).

``SimulatedNode`` is the agent's own ``NodeControl`` (joining, ticks, lease
checks, relay, fencing, plan writing), not a copy of it; ``tick`` makes the
store calls of one watch tick of an agent for the steady-state figures.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Sequence, Tuple

from peerstate.control import keys
from peerstate.control.stores import open_store
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.control.messages import MemberReport, RecoveryPlan, StateLayout
from peerstate.control.node_control import NodeControl
from peerstate.control.planning import node_of_worker
from peerstate.replication.placement import BuddyPlacement

LAYOUT = StateLayout(k=1, share_count=8, data_parallel=True)  # the default of a multi-node job of 8 ranks per node


def served_by(world_size: int, nproc: int, k: int) -> Dict[int, List[int]]:
    """holder -> the ranks whose snapshots it keeps (``BuddyPlacement``, inverted once)."""
    placement = BuddyPlacement([r // nproc for r in range(world_size)], k=k)
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
                self.members[rank] = worker
                self._fresh.add(rank)
            else:
                self.members.pop(rank, None)
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
                 layout: StateLayout = LAYOUT) -> None:
        self.node, self.nnodes, self.nproc, self.spares = node, nnodes, nproc, spares
        self.kv = open_store(store, timeout=120.0)  # HOST:PORT of a TCPStore, or etcd://...
        self.channel = SimulatedChannel(node, nproc, served, version, layout)
        self.failures: List[str] = []
        self.fenced = False
        # The relay's connection is a clone: one count for both, as in the agent.
        self.control = NodeControl(self.kv, node, nnodes, nproc, join_timeout=report_timeout,
                                   lease_timeout=lease_timeout, spare_timeout=report_timeout,
                                   on_failure=self.failures.append, on_fenced=self._on_fenced,
                                   say=lambda message: None)
        self.coordinator, self.writer, self.leases = self.control.coordinator, self.control.writer, self.control.leases
        self._began = False

    @property
    def relay(self):
        return self.control.relay

    def connect(self) -> None:
        """What the agent does when it starts, up to waiting for the other nodes (which a
        simulation starts one by one): agree on the shape, count in; its spares register."""
        self.control.count_in()
        for index in range(self.spares):
            self.coordinator.register_spare(f"n{self.node}.{self.nproc + index}")

    def start(self) -> None:
        """The rest of the agent's start: epoch 0, then the relay (again, after ``stop``:
        an agent that stalled and came back). Not its wait for every node to count in:
        the harness starts the nodes when it wants them to run."""
        if not self._began:
            self.control.begin()
            self._began = True
        self.control.start_relay(self.channel)

    def _on_fenced(self) -> None:
        self.fenced = True

    def tick(self, now: float) -> None:
        """One agent watch tick's store calls in the steady state (``Agent._watch``)."""
        self.control.tick([f"n{self.node}.{self.nproc + i}" for i in range(self.spares)])
        self.control.check_leases(now)

    def stop(self, wait: bool = True) -> None:
        """Stop the relay; ``wait=False`` only asks it to (stop many, then wait for each)."""
        self.control.stop_relay(wait)

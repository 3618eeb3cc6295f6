"""The control plane of a large job, simulated over a real store: what
``bench/scale.py`` measures and the protocol tests drive.

A ``SimulatedNode`` runs its agent's real recovery code (``NodeRelay``,
``InstructionWriter``, ``Coordinator``) against the job's real store, over a
connection of its own, exactly as ``peerstate run``'s agent does. What is
modelled, not run:
- the node channel is an in-process store (``SimulatedChannel``), and the
  members on it answer at once: when the relay copies a plan into it, each
  member of the node writes the report a worker writes (what it holds if it
  snapshotted every step up to ``version``); a worker's abort, its step and
  its restore are not run;
- process groups are not formed (that is torch's rendezvous, not ours).

``SimulatedNode.tick`` makes the store calls of one watch tick of an agent
(``launcher.agent.Agent._watch``) for the steady-state figures.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.stores import open_store
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.control.messages import MemberReport, RecoveryPlan, StateLayout
from peerstate.control.node_relay import NodeRelay
from peerstate.control.plan_writer import WRITER_MARGIN, InstructionWriter
from peerstate.control.planning import node_of_worker
from peerstate.control.leases import LeaseWatch
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
    """One node's agent, as far as the job's store sees it (see the module docstring)."""

    def __init__(self, store: str, node: int, nnodes: int, nproc: int, served: Dict[int, List[int]], *,
                 spares: int = 1, version: int = 100, report_timeout: float = 60.0, lease_timeout: float = 3.0,
                 layout: StateLayout = LAYOUT) -> None:
        self.node, self.nnodes, self.nproc, self.spares = node, nnodes, nproc, spares
        self.name = f"agent{node}"
        self.kv = open_store(store, timeout=120.0)  # HOST:PORT of a TCPStore, or etcd://...
        self.relay_kv = self.kv.clone()  # the relay's own connection, as in the agent (one count for both)
        self.coordinator = Coordinator(self.kv)
        relay_coordinator = Coordinator(self.relay_kv)
        self.channel = SimulatedChannel(node, nproc, served, version, layout)
        self.failures: List[str] = []
        self.fenced = False
        self.writer = InstructionWriter(self.relay_kv, relay_coordinator, self.name, None,
                                        report_timeout * WRITER_MARGIN, self.fence)
        self.relay = NodeRelay(self.relay_kv, self.channel, relay_coordinator, self.writer, node, self.name,
                               report_timeout, self.failures.append, self._on_fenced, lease_timeout)
        self.leases = LeaseWatch(self.kv, self.coordinator, node, nnodes, lease_timeout, self.name)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def connect(self) -> None:
        """What the agent does when it starts: agree on the shape, count in, start epoch 0,
        register its spares."""
        shape = {"nnodes": self.nnodes, "nproc_per_node": self.nproc, "world_size": self.nnodes * self.nproc}
        self.kv.compare_set(keys.CONFIG, b"", json.dumps(shape).encode())
        self.kv.add(keys.NODES_JOINED, 1)
        self.coordinator.start(self.name)
        for index in range(self.spares):
            self.coordinator.register_spare(f"n{self.node}.{self.nproc + index}")

    def start(self) -> None:
        """Run the relay (again, after ``stop``: an agent that stalled and came back)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.relay.run, args=(self._stop,), name=f"relay-{self.node}",
                                        daemon=True)
        self._thread.start()

    def fence(self, nodes: List[int], reason: str) -> None:
        """``InstructionWriter``'s late-node handler, as the agent's ``_fence``."""
        coordinator = Coordinator(self.relay_kv)  # on the relay's thread, as in the agent
        for node in nodes:
            if coordinator.declare_node_dead(node, self.name):
                coordinator.report_failure(coordinator.workers_on(node), reason, detected_at=time.time(), me=self.name)

    def _on_fenced(self) -> None:
        self.fenced = True

    def tick(self, now: float) -> None:
        """The store calls of one agent watch tick in the steady state: its lease, the
        job's failure and finish, its waiting spares' states, its ring window."""
        self.kv.add(keys.node_lease(self.node), 1)
        self.coordinator.failure()
        self.kv.add(keys.JOB_FINISHED, 0)
        if self.spares:
            self.kv.get_many([keys.spare_state(f"n{self.node}.{self.nproc + i}") for i in range(self.spares)])
        self.leases.check(now)

    def stop(self, wait: bool = True) -> None:
        """Stop the relay; ``wait=False`` only asks it to (stop many, then wait for each)."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=5.0)

"""A node's part of the control plane, over the job's store, as one part: join
the job, keep the node's lease and watch its ring window, relay each epoch
between the store and the node channel (``NodeRelay``), fence nodes that report
too late, and write a recovery plan when a failure is seen.

The agent of ``peerstate run`` runs it beside what is its own (the processes,
their hangs, the spare pool, the findings); ``tools.simulation`` runs the same
object for thousands of simulated nodes on one machine, so what
``bench/scale.py`` measures is this code, not a copy of it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.leases import LeaseWatch
from peerstate.control.node_relay import NodeRelay
from peerstate.control.plan_writer import WRITER_MARGIN, InstructionWriter
from peerstate.control.timeline import EventLog, RecoveryTimelines
from peerstate.errors import JobFailedError


def _say(message: str) -> None:
    print(f"peerstate: {message}", file=sys.stderr, flush=True)


@dataclass
class NodeTick:
    """What one watch tick read of the job: its failure (None while it runs), how many
    ranks finished, and the state of each waiting spare (``keys.spare_state``)."""

    failure: Optional[str]
    finished: int
    spare_states: Dict[str, Optional[bytes]]


class NodeControl:
    """Node ``node``'s control plane. ``kv`` is its connection to the job's store
    (the watch tick's; the relay and each plan writer open their own with
    ``clone()``, so that their waits never delay the lease).

    Callbacks, each called from the thread that found it: ``on_failure(message)``
    when the job cannot go on (default: the job's failure is set, which every agent
    reads at its next tick); ``on_fenced()`` when this node was declared lost while
    it lives (its agent must stop its workers); ``say(message)`` for what an
    operator should read (default: the console). ``events`` (optional) gets
    ``failure_detected``, ``plan`` and, from the node that assembles it, each
    recovery's ``recovery`` timeline."""

    def __init__(self, kv: KeyValueStore, node: int, nnodes: int, nproc_per_node: int, *, join_timeout: float,
                 lease_timeout: float, spare_timeout: float, events: Optional[EventLog] = None,
                 on_failure: Optional[Callable[[str], None]] = None, on_fenced: Callable[[], None] = lambda: None,
                 say: Callable[[str], None] = _say) -> None:
        self.kv = kv
        self.node, self.nnodes, self.nproc_per_node = node, nnodes, nproc_per_node
        self.world_size = nnodes * nproc_per_node
        self.name = f"agent{node}"
        self.join_timeout, self.lease_timeout, self.spare_timeout = join_timeout, lease_timeout, spare_timeout
        self.events = events
        self.coordinator = Coordinator(kv)
        self.leases = LeaseWatch(kv, self.coordinator, node, nnodes, lease_timeout, self.name)
        self.on_failure = on_failure or self.fail
        self._on_fenced = on_fenced
        self._say = say
        self._reporting = threading.Lock()  # one plan writer of this node at a time
        self._relay_kv = kv.clone()  # the relay's, and its instruction writer's
        self._relay_coordinator = Coordinator(self._relay_kv)
        self.writer = InstructionWriter(self._relay_kv, self._relay_coordinator, self.name, events,
                                        join_timeout * WRITER_MARGIN, self.fence)
        self.relay: Optional[NodeRelay] = None
        self._relay_stop = threading.Event()
        self._relay_thread: Optional[threading.Thread] = None

    # -- joining ------------------------------------------------------------------------
    def connect(self) -> None:
        """``count_in``, ``await_nodes``, then ``begin``."""
        self.count_in()
        self.await_nodes()
        self.begin()

    def count_in(self) -> None:
        """Agree on the job's shape and count this node in. JobFailedError, with the job
        failed, when the shapes differ; JobFailedError when a node is counted twice."""
        shape = {"nnodes": self.nnodes, "nproc_per_node": self.nproc_per_node, "world_size": self.world_size}
        agreed = json.loads(self.kv.compare_set(keys.CONFIG, b"", json.dumps(shape).encode()))
        if agreed != shape:
            message = (f"node {self.node} was started with {shape} but the job was started with {agreed}: every "
                       "agent needs the same --nnodes and --nproc-per-node")
            self.fail(message)
            raise JobFailedError(message)
        if self.kv.add(keys.NODES_JOINED, 1) > self.nnodes:
            raise JobFailedError(f"more agents joined than --nnodes {self.nnodes}: two were started with the same "
                                 "--node-rank, or the job's keys are a finished job's (give each run its own "
                                 "--job-id)")

    def await_nodes(self) -> None:
        """Wait (up to ``join_timeout``) until every node counted in. JobFailedError, with
        the job failed, when they do not all come."""
        deadline = time.monotonic() + self.join_timeout
        while self.kv.add(keys.NODES_JOINED, 0) < self.nnodes:
            if self.coordinator.failure():
                raise JobFailedError(self.coordinator.failure())
            if time.monotonic() > deadline:
                joined = self.kv.add(keys.NODES_JOINED, 0)
                message = f"only {joined} of {self.nnodes} nodes joined within {self.join_timeout:.0f}s"
                self.fail(message)
                raise JobFailedError(message)
            time.sleep(0.02)

    def begin(self) -> None:
        """Start epoch 0 (every node does; the first one's plan stands)."""
        self.coordinator.start(self.name)

    def start_relay(self, channel: KeyValueStore,
                    certify: Optional[Callable[[str, int], Optional[bytes]]] = None) -> None:
        """Relay the recovery protocol between the job's store and ``channel`` (the node
        channel, a connection the relay's thread owns) on a thread and a store
        connection of its own; again after ``stop_relay`` (an agent that stalled and
        came back: the same relay, where it left off). ``certify(worker, rank)``: the
        certificate a spare of this node needs for a rank a plan gives it."""
        if self.relay is None:
            marks_coordinator = Coordinator(self._relay_kv.clone())  # the marks' thread's (NodeRelay step 5)
            timelines = RecoveryTimelines(marks_coordinator.kv, lambda epoch: marks_coordinator.plan(epoch).__dict__,
                                          self.nnodes, self.world_size, self.events, self._say)
            self.relay = NodeRelay(self._relay_kv, channel, self._relay_coordinator, self.writer, self.node,
                                   self.name, self.join_timeout, self.on_failure, self._on_fenced,
                                   self.lease_timeout, timelines, certify)
        self._relay_stop = threading.Event()
        self._relay_thread = threading.Thread(target=self.relay.run, args=(self._relay_stop,),
                                              name=f"peerstate-relay-{self.node}", daemon=True)
        self._relay_thread.start()

    def stop_relay(self, wait: bool = True) -> None:
        """Stop the relay; ``wait=False`` only asks it to (stop many, then wait for each).
        Its blocked wait must end before the stores go away."""
        self._relay_stop.set()
        if wait and self._relay_thread is not None:
            self._relay_thread.join(timeout=5.0)

    def close(self) -> None:
        """Stop the relay for good (the agent's end): its wait for the next plan is
        interrupted rather than waited out (up to ``PLAN_WAIT_SECONDS`` of every
        agent's exit), and its connection and its writer's are done."""
        self._relay_stop.set()
        self._relay_kv.interrupt()
        self.stop_relay()

    # -- watching -----------------------------------------------------------------------
    def tick(self, spares: Sequence[str] = ()) -> NodeTick:
        """The store calls of one watch tick: bump this node's lease, read the job's
        failure and how many ranks finished, and the states of the waiting ``spares``."""
        self.kv.add(keys.node_lease(self.node), 1)
        failure = self.coordinator.failure()
        finished = self.kv.add(keys.JOB_FINISHED, 0)
        states = dict(zip(spares, self.kv.get_many([keys.spare_state(w) for w in spares]))) if spares else {}
        return NodeTick(failure, finished, states)

    def check_leases(self, now: float) -> List[int]:
        """Declare the nodes of this node's ring window whose lease stopped (see
        ``LeaseWatch``), report their workers' failure, and return those nodes."""
        declared = self.leases.check(now)
        for node, still in declared:
            self.report(self.coordinator.workers_on(node), f"node {node} lost: its lease expired {still:.1f}s ago",
                        time.time() - (still - self.lease_timeout))
        return [node for node, _ in declared]

    @property
    def relaying(self) -> bool:
        """Whether the relay's thread runs."""
        return self._relay_thread is not None and self._relay_thread.is_alive()

    def fence(self, nodes: List[int], reason: str) -> None:
        """Nodes that did not report in time (``InstructionWriter``'s late-node handler):
        declared lost (their agents stop their workers when they see it) and their ranks
        handed to spares. Runs on the relay's thread: its own connection, not the tick's."""
        coordinator = Coordinator(self.kv.clone())
        for node in nodes:
            if coordinator.declare_node_dead(node, self.name):
                self.report(coordinator.workers_on(node), f"{reason}: node {node} is declared lost", time.time())

    # -- failing ------------------------------------------------------------------------
    def report(self, workers: List[str], reason: str, detected_at: float) -> None:
        """``workers`` failed: write the recovery plan that replaces them, on a thread of
        its own (waiting for a spare takes a while), or stop the job where no recovery
        can include every rank (some finished their last step)."""
        if self.events is not None:
            self.events.write("failure_detected", workers=workers, reason=reason, detected_at=detected_at)
        self._say(reason)
        finished = self.kv.add(keys.JOB_FINISHED, 0)
        if finished >= self.world_size:
            return  # every rank finished: nothing is left to recover
        if finished:
            # A recovery replays from the last common step with every member; a finished one has
            # left its loop and would never join. Stopping now beats waiting out the join timeout.
            self.on_failure(f"{reason} after {finished} of the job's {self.world_size} ranks had finished their "
                            "last step: they have left the training loop, so the step it was in cannot be replayed "
                            "with them. What the finished ranks wrote after their loop stands; this rank's last "
                            "steps are lost")
            return
        threading.Thread(target=self._write_plan, args=(workers, reason, detected_at), name="peerstate-report",
                         daemon=True).start()

    def _write_plan(self, workers: List[str], reason: str, detected_at: float) -> None:
        try:
            with self._reporting:
                # Its own connection: waits on this one must not delay the lease on the tick's.
                coordinator = Coordinator(self.kv.clone())
                plan = coordinator.report_failure(workers, reason, detected_at=detected_at, me=self.name,
                                                  spare_timeout=self.spare_timeout,
                                                  writer_grace=self.lease_timeout + 30)
            if plan is not None and self.events is not None:
                self.events.write("plan", epoch=plan.epoch, failed=plan.failed, replaced=plan.replaced,
                                  reason=plan.reason, detected_at=plan.detected_at, planned_at=plan.planned_at)
        except JobFailedError as error:
            self.on_failure(str(error))
        except Exception as error:  # noqa: BLE001 - the store is gone: the job is over
            self.on_failure(f"could not write a recovery plan: {error}")

    def fail(self, message: str) -> None:
        """Stop the job, saying why (the first reason wins)."""
        self.coordinator.fail_job(message)

"""A node's part of every epoch, run by its agent: the only path between the
node's workers and the job's store in the recovery protocol.

For each epoch, in order:
1. wait for the epoch's plan in the job's store and copy it into the node
   channel (the workers' watchers wait there, and abort at once);
2. gather the reports of the node's members from the channel and publish
   them as one ``NodeReport``;
3. if this agent owns the epoch, write every node's instructions
   (``InstructionWriter``); if the owner's node is declared lost first, take
   the epoch over and write them;
4. read this node's ``NodeInstructions`` once and put them in the channel as
   they are: each member expands its own part (``planning.expand``, with the
   reports of its node's members, which are in the channel already);
5. after a recovery's epoch, as soon as every member of the node has put its
   timeline marks in the channel (after its first step), publish them as one
   entry (``RecoveryTimelines``), on a thread that waits on the channel
   (``MarksForwarder``): the relay itself is back to waiting for the next plan.

Per node and epoch that is a handful of requests to the job's store whatever
the job's size; the members' own traffic stays on the node. Every wait also
looks for a newer epoch, which makes the current one moot (its members have
moved on to it too).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import KeyValueStore, store_gone
from peerstate.control.messages import NodeReport, RecoveryPlan
from peerstate.control.plan_writer import InstructionWriter
from peerstate.control.planning import node_of_worker
from peerstate.control.timeline import RecoveryTimelines
from peerstate.errors import JobFailedError

POLL_SECONDS = 0.25  # how often a wait on the node's members looks for a newer epoch
PLAN_WAIT_SECONDS = 1.0  # the wait for the next plan


class NodeRelay:
    """Runs steps 1-4 for node ``node`` (``run`` until ``stop`` is set).

    ``kv``: the job's store (a connection of its own: it blocks in waits);
    ``channel``: the node channel its workers use. ``report_timeout``: how long
    the node's members may take to report (then ``on_failure`` is told which did
    not, and the relay moves on to the next epoch, which that failure starts).
    ``on_fenced()``: this node was declared lost while its agent lives (checked
    once per epoch); the relay stops. ``takeover_poll``: how often a node waiting
    for its instructions looks for an owner lost without a newer epoch (its node
    had no member left), which only this node can then take over: the lease
    timeout, since a lost node is declared a lease timeout after it stops. A newer
    epoch needs no looking: its plan's writer marks this one moot in every node's
    instructions key (``Coordinator._retire``).

    ``timelines`` (optional) publishes the members' marks of each recovery (step 5).
    ``certify(worker, rank)`` (optional) certifies a spare of this node for the rank
    a plan gives it; the certificate is in the channel before the plan (step 1).
    """

    def __init__(self, kv: KeyValueStore, channel: KeyValueStore, coordinator: Coordinator, writer: InstructionWriter,
                 node: int, me: str, report_timeout: float, on_failure: Callable[[str], None],
                 on_fenced: Callable[[], None], takeover_poll: float,
                 timelines: Optional[RecoveryTimelines] = None,
                 certify: Optional[Callable[[str, int], Optional[bytes]]] = None) -> None:
        self._kv = kv
        self._channel = channel
        self._coordinator = coordinator
        self._writer = writer
        self.node = node
        self._me = me
        self.report_timeout = report_timeout
        self._on_failure = on_failure
        self._on_fenced = on_fenced
        self.takeover_poll = takeover_poll
        self._mirrored = -1  # the newest plan copied into the channel
        self._stopping = threading.Event()  # run()'s stop
        self._local: Optional[Dict[int, str]] = None  # rank -> worker of this node's members, as of the last plan
        self._fenced = False  # some of this node's ranks went to other nodes in the last plan
        self._marks = MarksForwarder(channel, timelines, node) if timelines is not None else None
        self._certify = certify

    def run(self, stop: threading.Event) -> None:
        """Relay epochs until ``stop``; a JobFailedError (an owner that neither wrote
        nor was declared lost) goes to ``on_failure``, and so does a lost store."""
        self._stopping = stop
        try:
            while not stop.is_set():
                plan = self._next_plan(stop)
                if plan is not None and self.relay(plan) and plan.epoch > 0 and self._marks and self._local:
                    self._marks.forward(plan.epoch, sorted(self._local))
        except JobFailedError as error:
            self._on_failure(str(error))
        except Exception as error:  # noqa: BLE001 - said by the agent, or here
            if store_gone(error):
                return  # the agent's own calls meet the same store, and stop it
            if not stop.is_set():
                self._on_failure(f"node {self.node} could not relay the recovery protocol: {error}")
        finally:
            if self._marks is not None:
                self._marks.stop()  # the job's end: members that ran their first step have marked it

    def _next_plan(self, stop: threading.Event) -> Optional[RecoveryPlan]:
        """The newest plan once there is one newer than the last relayed, each plan
        in between copied into the channel first (watchers wait on them in order)."""
        try:
            self._kv.wait([keys.epoch_plan(self._mirrored + 1)], timeout=PLAN_WAIT_SECONDS)
        except TimeoutError:
            return None
        # Not past the plan waited for: a newer one, if any, is the next wait's (and it marks this one
        # moot, which ends this epoch's wait for instructions at once). One request fewer per node.
        plans = self._coordinator.new_plans(known=self._mirrored + 1, upto=self._mirrored + 1)
        if not plans:
            return None
        if self._local is None:
            nproc = self._coordinator.shape()["nproc_per_node"]
            self._local = {self.node * nproc + k: f"n{self.node}.{k}" for k in range(nproc)}
        self._fenced = False
        certificates = []
        for plan in plans:  # O(changes): a node never scans the whole membership
            for rank, worker in plan.replaced.items():
                if node_of_worker(worker) == self.node:
                    self._local[rank] = worker
                    certificate = self._certify(worker, rank) if self._certify else None
                    if certificate is not None:
                        certificates.append((keys.rank_certificate(worker, rank), certificate))
                elif self._local.pop(rank, None) is not None:
                    self._fenced = True
        # One request; the store sets the keys in order, so a spare that sees its plan finds its certificate.
        self._channel.set_many(certificates + [(keys.epoch_plan(p.epoch), p.encode()) for p in plans])
        self._mirrored = plans[-1].epoch
        return plans[-1] if not stop.is_set() else None

    def _newer(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` is moot: a newer one began, or the relay is stopping."""
        return self._stopping.is_set() or self._kv.get(keys.epoch_plan(epoch + 1)) is not None

    def relay(self, plan: RecoveryPlan) -> bool:
        """Steps 2-4 for ``plan``'s epoch, the newest one ``_next_plan`` returned; False
        when a newer epoch made it moot."""
        epoch = plan.epoch
        if self._fenced and self._coordinator.node_dead(self.node):
            self._on_fenced()  # this node's ranks went elsewhere because it was declared lost
            return False
        local = sorted(self._local)
        encoded: List[bytes] = []
        if local:
            encoded = self._gather(epoch, local)
            if encoded is None:
                return False
            self._kv.set(keys.node_report(epoch, self.node), NodeReport.join(self.node, encoded))
        if plan.writer == self._me:  # the owner, unless it was lost since (then see wait_or_take_over)
            if not self._writer.write(plan, lambda: self._newer(epoch)):
                return False
        if not local:
            return True
        key = keys.node_instructions(epoch, self.node)
        moot: List[bool] = []

        def newer() -> bool:
            if self._newer(epoch):
                moot.append(True)
            return bool(moot)

        while self._coordinator.wait_or_take_over(epoch, key, self._me, self.report_timeout * 2,
                                                  "restore instructions", newer=newer, poll=self.takeover_poll):
            if not self._writer.write(plan, newer):  # the owner's node was lost: the epoch is ours now
                return False
        orders = None if moot else self._kv.get_existing([key])[0]
        if orders is None or orders == keys.MOOT:
            return False
        # Handed over as read: each member expands its own part (planning.expand) in its own process.
        self._channel.set_many([(keys.member_instructions(epoch, self.node), orders)])
        return True

    def _gather(self, epoch: int, ranks: List[int]) -> Optional[List[bytes]]:
        """The members' reports as they wrote them (None once moot, or past the deadline)."""
        names = [keys.member_report(epoch, r) for r in ranks]
        try:
            if not self._channel.wait_until(names, time.monotonic() + self.report_timeout,
                                            lambda: self._newer(epoch), poll=POLL_SECONDS):
                return None
        except TimeoutError:
            missing = [r for r, raw in zip(ranks, self._channel.get_many(names)) if raw is None]
            self._on_failure(f"ranks {missing} did not join epoch {epoch} within {self.report_timeout:.0f}s")
            return None
        return self._channel.get_existing(names)


class MarksForwarder:
    """Step 5: publishes the marks of a recovery's members (``RecoveryTimelines``) as
    soon as the last of them is in the node channel. A thread of its own waits on a
    connection of its own to the channel, so the marks never wait for the relay's next
    plan wait (a node lost a moment after its members' first step has published by
    then), and the job's store sees no request until they are all in. A newer epoch's
    ``forward`` replaces the wait (an interrupted recovery has no complete timeline);
    ``stop`` ends it after a last look."""

    def __init__(self, channel: KeyValueStore, timelines: RecoveryTimelines, node: int) -> None:
        self._source = channel
        self._node = node
        self._channel: Optional[KeyValueStore] = None  # cloned at the first recovery
        self._timelines = timelines
        self._lock = threading.Lock()
        self._due: Optional[Tuple[int, List[int]]] = None  # (epoch, the node's members)
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def forward(self, epoch: int, ranks: List[int]) -> None:
        """Publish epoch ``epoch``'s marks once ``ranks`` (the node's members) have all
        put theirs in the channel; returns at once."""
        with self._lock:
            self._due = (epoch, ranks)
            if self._thread is None:
                if self._channel is None:
                    self._channel = self._source.clone()
                self._thread = threading.Thread(target=self._run, name="peerstate-marks", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Publish what is complete now, and end the thread (a relay started again
        forwards again)."""
        self._stopping.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
        with self._lock:
            self._due = None
        self._stopping.clear()

    def _run(self) -> None:
        while True:
            with self._lock:
                due = self._due
                if due is None:
                    self._thread = None
                    return
            epoch, ranks = due
            names = [keys.recovery_marks(epoch, r) for r in ranks]
            try:  # a moot wait still publishes what is complete: one last look
                self._channel.wait_until(names, math.inf, moot=lambda: self._stopping.is_set() or self._due != due,
                                         poll=POLL_SECONDS)
            except Exception as error:  # noqa: BLE001 - the channel went with the agent
                if not store_gone(error):
                    self._timelines.say(f"peerstate: the marks of epoch {epoch} could not be read: {error}")
                with self._lock:
                    self._due = None if self._due == due else self._due
                continue
            self._publish(due, names)
            with self._lock:
                if self._due == due or self._stopping.is_set():
                    self._due = None

    def _publish(self, due: Tuple[int, List[int]], names: List[str]) -> None:
        """One look: publish when every member's marks are in (else the recovery did not
        complete on this node: a newer epoch came, or the job ended first)."""
        epoch, ranks = due
        try:
            marks = self._channel.get_many(names)
            if all(raw is not None for raw in marks):
                self._timelines.publish(epoch, self._node, dict(zip(ranks, marks)))
        except Exception as error:  # noqa: BLE001 - the timeline is lost, and said to be
            if not store_gone(error):
                self._timelines.say(f"peerstate: the timeline of epoch {epoch} could not be published: {error}")

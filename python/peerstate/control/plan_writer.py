"""The plan writer's second half: once an epoch's plan names what changed, the
agent that owns the epoch gathers one ``NodeReport`` per node, computes every
member's instructions once (the recovery point, each restore plan, the
addresses each member needs) and writes them as one ``NodeInstructions`` per
node. Its store work for an epoch: one wait and one read of the node reports,
one write of all the instructions, whatever the number of ranks.

A node whose report has not come by ``report_timeout`` is fenced: it is
declared lost and its ranks are handed to spares in a newer epoch (which makes
this one moot), so a late report is never planned with.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.messages import MemberReport, NodeInstructions, NodeReport, RecoveryPlan, StateLayout
from peerstate.control.planning import lost_without_checkpoint, node_of_worker, plan_nodes
from peerstate.control.timeline import EventLog
from peerstate.errors import JobFailedError
from peerstate.replication.parity import ParityPlacement
from peerstate.replication.placement import BuddyPlacement, DataParallelShares, mesh_replica_sets


# The writer waits longer for a node's report than a node waits for its own members
# (report_timeout x this): a node whose workers hang says so itself; one whose agent
# stalls is fenced.
WRITER_MARGIN = 1.5


class InstructionWriter:
    """Writes the instructions of the epochs its agent owns (``write``)."""

    def __init__(self, kv: KeyValueStore, coordinator: Coordinator, me: str, events: Optional[EventLog],
                 report_timeout: float, on_late: Callable[[List[int], str], None]) -> None:
        """``on_late(nodes, reason)``: fence nodes that did not report in time (the
        agent declares them lost and reports their workers failed)."""
        self._kv = kv
        self._coordinator = coordinator
        self._me = me
        self._events = events
        self.report_timeout = report_timeout
        self._on_late = on_late
        self._layouts: Dict[StateLayout, Tuple[BuddyPlacement, DataParallelShares]] = {}
        self.last_compute_s = 0.0  # how long the last computation took (bench/scale.py reports it)
        self.last_times: Dict[str, float] = {}  # wall-clock times of the last write's steps (ditto)

    def write(self, plan: RecoveryPlan, newer: Callable[[], bool]) -> bool:
        """Gather ``plan``'s node reports and write every node's instructions. False
        when the epoch became moot first (``newer()``, or late nodes fenced)."""
        self.last_times = {"started": time.time()}
        with _collector_paused():
            reports = self._gather(plan, newer)
            if reports is None:
                return False
            self.last_times["gathered"] = time.time()
            started = time.perf_counter()
            orders = self.instructions(plan, reports)
            self.last_compute_s = time.perf_counter() - started
            self._kv.set_many([(keys.node_instructions(plan.epoch, node), order.encode())
                               for node, order in orders.items()])
        self.last_times["published"] = time.time()
        return True

    def _gather(self, plan: RecoveryPlan, newer: Callable[[], bool]) -> Optional[Dict[int, MemberReport]]:
        nodes = sorted({node_of_worker(w) for w in plan.members.values()})
        names = [keys.node_report(plan.epoch, n) for n in nodes]
        try:
            if not self._kv.wait_until(names, time.monotonic() + self.report_timeout, newer):
                return None
        except TimeoutError:
            late = [n for n, raw in zip(nodes, self._kv.get_many(names)) if raw is None]
            self._on_late(late, f"node{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not "
                                f"report for epoch {plan.epoch} within {self.report_timeout:.0f}s")
            return None
        reports: Dict[int, MemberReport] = {}
        raws = self._kv.get_existing(names)
        self.last_times["read"] = time.time()
        for raw in raws:
            for report in NodeReport.decode(raw).members:
                reports[report.rank] = report
        missing = sorted(set(plan.members) - set(reports))
        if missing:
            raise JobFailedError(f"peerstate bug: the node reports of epoch {plan.epoch} lack ranks {missing}")
        return reports

    def instructions(self, plan: RecoveryPlan, reports: Dict[int, MemberReport]) -> Dict[int, NodeInstructions]:
        """Every node's instructions for ``plan``'s epoch (``planning.plan_nodes``); a
        loss without a checkpoint also stops the job."""
        layout = self._layout(reports)
        placement, shares = self._placement(layout, len(reports))
        orders = plan_nodes(plan.epoch, reports, placement, shares if layout.data_parallel else None, plan.failed,
                            _common_checkpoint(reports) if plan.epoch > 0 else None)
        self._note_loss(plan, reports, next(iter(orders.values())))
        return orders

    def _layout(self, reports: Dict[int, MemberReport]) -> StateLayout:
        """The layout the members that hold state agree on. A member that needs state
        does not count: a replacement may join before its script reached track()
        (FSDP2 shards its model only once it has a rank), with nothing placed yet."""
        holding = [r.layout for r in reports.values() if not r.needs_state] or [r.layout for r in reports.values()]
        layouts = set(holding)
        if len(layouts) > 1:
            message = (f"the members disagree on how the state is placed ({sorted(map(str, layouts))}): every rank "
                       "must call Job() and track() with the same k, data_parallel_shares and data_parallel")
            self._coordinator.fail_job(message)
            raise JobFailedError(message)
        return layouts.pop()

    def _placement(self, layout: StateLayout,
                   world_size: int) -> Tuple[Union[BuddyPlacement, ParityPlacement], DataParallelShares]:
        if layout not in self._layouts:
            nproc = self._coordinator.shape()["nproc_per_node"]
            nodes = [r // nproc for r in range(world_size)]  # the placement's nodes are the initial ones
            sets = mesh_replica_sets(world_size, layout.replica_mesh, layout.replica_dim) if layout.replica_mesh \
                else None
            placement = ParityPlacement(nodes, layout.parity_group) if layout.parity_group else \
                BuddyPlacement(nodes, k=layout.k)
            self._layouts[layout] = (placement, DataParallelShares(nodes, layout.share_count, sets))
        return self._layouts[layout]

    def _note_loss(self, plan: RecoveryPlan, reports: Dict[int, MemberReport], orders: NodeInstructions) -> None:
        if orders.outcome == "lost":
            reason = lost_without_checkpoint(orders.message)
            self._coordinator.fail_job(reason)
            if self._events is not None:
                held = {r: {"local": m.local, "replicas": m.replicas, "needs_state": m.needs_state}
                        for r, m in reports.items()}
                self._events.write("state_lost", epoch=plan.epoch, message=reason, held=held)
        elif orders.outcome == "checkpoint" and self._events is not None:
            self._events.write("checkpoint_fallback", epoch=plan.epoch, message=orders.message, step=orders.version,
                               path=orders.checkpoint)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a plan's decoding and computing: they
    allocate a few objects per rank (lists and dicts, no cycles), and every
    collection their allocations trigger rescans all of them; at 16,384 ranks that
    made the decoding of the node reports five times slower."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _common_checkpoint(reports: Dict[int, MemberReport]) -> Optional[Tuple[int, str]]:
    """The disk checkpoint every member can load: the oldest newest one reported
    (a member that reports none means there is none for all)."""
    found = [r.checkpoint for r in reports.values()]
    if not found or any(c is None for c in found):
        return None
    return min(found)

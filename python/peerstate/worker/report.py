"""The recovery report: each recovery's timeline (its phases, marked by every
member and assembled by the last one to publish), and the job's goodput."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.messages import RecoveryPlan
from peerstate.control.timeline import EventLog, read_events, recovery_timeline


class RecoveryReport:
    """Marks the phases of this member's recoveries and times its steps."""

    def __init__(self, kv: KeyValueStore, coordinator: Coordinator, events: EventLog, events_path: Optional[str],
                 world_size: int) -> None:
        self._kv = kv
        self._coordinator = coordinator
        self.events = events
        self._events_path = events_path
        self._world_size = world_size
        self.marks: Dict[str, float] = {}
        self.first_step_after: Optional[int] = None  # the step whose end closes the current recovery
        self.pulled: Optional[Dict[str, Any]] = None  # the last recovery's data-parallel pulls
        self.step_seconds: List[float] = []
        self.replayed_steps = 0  # steps this member ran again after its rollbacks, past each recovery's first
        self._start_recorded = False
        self._requests_at: Optional[int] = None  # the job-store requests count when this recovery began

    def recovery_began(self) -> None:
        """This member joins a recovery's epoch (the first of several if newer ones
        supersede it): its requests to the job's store are counted from here to the
        recovery's end, and said in the ``store_requests`` event (docs/recovery.md
        lists the ones a recovery makes)."""
        if self._requests_at is None:
            self._requests_at = self._kv.count.requests

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.time()

    def end_step(self, step: int, seconds: float, epoch: int, rank: int) -> None:
        """After step ``step``'s boundary: close a recovery, or count the step."""
        if self.first_step_after == step:
            self.first_step_after = None
            self._publish(epoch, rank, step - 1)
        else:
            self.step_seconds.append(seconds)
        if not self._start_recorded:  # the job's wall clock starts with its first step
            self._kv.compare_set(keys.JOB_STARTED, b"", str(time.time() - seconds).encode())
            self._start_recorded = True

    def _publish(self, epoch: int, rank: int, version: int) -> None:
        if self.pulled is not None:
            self.events.write("pulled", **self.pulled)
            self.pulled = None
        self._kv.set(keys.recovery_marks(epoch, rank), json.dumps(self.marks).encode())
        last = self._kv.add(keys.marks_done(epoch), 1) == self._world_size
        if last:
            self._assemble(epoch, version)
        if self._requests_at is not None:
            self.events.write("store_requests", epoch=epoch, rank=rank, assembled=last,
                              job_store=self._kv.count.requests - self._requests_at)
            self._requests_at = None

    def _assemble(self, epoch: int, version: int) -> None:
        """The last member to publish its marks: the recovery's timeline, from everyone's."""
        plan = self._coordinator.plan(epoch)
        raw = self._kv.get_many([keys.recovery_marks(epoch, r) for r in range(self._world_size)])
        marks = {r: json.loads(m) for r, m in enumerate(raw) if m}
        fault = _fault_time(self._events_path, plan)
        timeline = recovery_timeline(plan.__dict__, marks.values(), fault)
        self.events.write("recovery", **timeline, marks=marks, version=version)
        self._kv.set(keys.recovery_seconds(epoch), str(timeline["total_s"]).encode())
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in timeline["phases_s"].items() if v is not None)
        print(f"peerstate: recovered epoch {epoch} (ranks {plan.failed}) in {timeline['total_s']:.2f}s "
              f"from {timeline['from']}: {phases}", file=sys.stderr, flush=True)

    def finish(self, total: int, epochs: int) -> None:
        """This rank finished the loop; the last rank to finish reports the job.

        Goodput is the share of the wall time (first step to last) not lost to failures:
        lost is each recovery's time from the fault to its first step's end, plus the
        further steps replayed after it (at the median step time). A long step that
        is no failure (an evaluation, a checkpoint save) is not lost time.
        ``bench/parallelisms.py`` also measures it against the same script run without
        peerstate's capture."""
        if self._kv.add(keys.JOB_FINISHED, 1) != self._world_size:
            return
        started = float(self._kv.get(keys.JOB_STARTED) or time.time())
        wall = time.time() - started
        step_s = statistics.median(self.step_seconds) if self.step_seconds else 0.0
        recovered = [float(raw) for raw in self._kv.get_many([keys.recovery_seconds(e) for e in range(1, epochs + 1)])
                     if raw]
        lost = sum(recovered) + self.replayed_steps * step_s
        goodput = max(0.0, 1.0 - lost / wall) if wall > 0 else 0.0
        self.events.write("job_end", steps=total, wall_s=wall, median_step_s=step_s, goodput=goodput, lost_s=lost,
                          recoveries=len(recovered), replayed_steps=self.replayed_steps)
        print(f"peerstate: job finished {total} steps in {wall:.2f}s through {len(recovered)} recoveries; goodput "
              f"{goodput:.1%} ({lost:.2f}s lost to failures: {sum(recovered):.2f}s recovering, "
              f"{self.replayed_steps} steps replayed)", file=sys.stderr, flush=True)


def _fault_time(events_path: Optional[str], plan: RecoveryPlan) -> Optional[float]:
    """When the fault this plan answers was injected, if the injector logged it."""
    if not events_path or not os.path.exists(events_path):
        return None
    faults = [e["time"] for e in read_events(events_path)
              if e["event"] == "fault_injected" and plan.detected_at - 60 < e["time"] <= plan.detected_at]
    return max(faults) if faults else None

"""The recovery report: each recovery's timeline (its phases, marked by every
member, forwarded by its agent and assembled by the agent that completes them:
``control.timeline.RecoveryTimelines``), and the job's goodput."""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog


class RecoveryReport:
    """Marks the phases of this member's recoveries and times its steps."""

    def __init__(self, kv: KeyValueStore, channel: KeyValueStore, events: EventLog, world_size: int) -> None:
        self._kv = kv
        self._channel = channel  # the node channel: the marks go to the agent
        self.events = events
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
        entry = {"marks": self.marks, "version": version}
        self._channel.set(keys.recovery_marks(epoch, rank), json.dumps(entry).encode())
        if self._requests_at is not None:
            self.events.write("store_requests", epoch=epoch, rank=rank, job_store=self._kv.count.requests -
                              self._requests_at)
            self._requests_at = None

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


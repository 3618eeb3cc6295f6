"""The job's event log (JSON lines), and each recovery's timeline.

Every process of a node appends to one file, one ``write()`` per line with
O_APPEND, so lines from several processes never interleave. Each line has
``time`` (seconds since the epoch), ``event`` and ``source`` (who wrote it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore

PHASES = ("detect", "plan", "abort", "re-form", "transfer", "restore", "first step")


class EventLog:
    """Appends events to ``path`` (no file: events are dropped)."""

    def __init__(self, path: Optional[str], source: str) -> None:
        self.path = path
        self.source = source

    def write(self, event: str, **fields: Any) -> Dict[str, Any]:
        entry = {"time": time.time(), "event": event, "source": self.source, **fields}
        if self.path:
            line = (json.dumps(entry, default=str) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return entry


def read_events(path: str) -> List[Dict[str, Any]]:
    """The complete events of a log that other processes may be appending to: a last
    line without its newline is still being written, and is left for the next read."""
    with open(path) as f:
        text = f.read()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def recovery_timeline(plan: Dict[str, Any], marks: Iterable[Dict[str, float]],
                      fault_time: Optional[float] = None) -> Dict[str, Any]:
    """The phases of one recovery, in seconds, from the plan and every member's marks.

    ``marks`` holds, per member, the times it finished ``abort``, ``re-form``,
    ``transfer`` (replacements only), ``restore`` and ``first step``. A phase ends
    when its last member finishes it; phases are the gaps between those ends, so
    they add up to the whole recovery. ``detect`` runs from the fault (when the
    injector recorded it) to the agent seeing it; ``plan`` from there to the plan
    being written (it includes waiting for a spare when none was ready).
    """
    marks = list(marks)
    start = plan["detected_at"]
    ends: Dict[str, float] = {"plan": plan.get("planned_at", start)}
    previous = ends["plan"]
    for phase in PHASES[2:]:
        times = [m[phase] for m in marks if phase in m]
        ends[phase] = max(times) if times else previous
        previous = max(previous, ends[phase])
    phases: Dict[str, float] = {"detect": (start - fault_time) if fault_time else None}
    previous = start
    for phase in PHASES[1:]:
        phases[phase] = max(0.0, ends[phase] - previous)
        previous = max(previous, ends[phase])
    total_from = fault_time if fault_time else start
    return {"epoch": plan["epoch"], "failed": plan["failed"], "replaced": plan["replaced"],
            "reason": plan["reason"], "phases_s": phases,
            "total_s": previous - total_from, "from": "fault" if fault_time else "detection"}


def fault_time(events_path: Optional[str], plan: Dict[str, Any]) -> Optional[float]:
    """When the fault ``plan`` answers was injected, if the injector logged it."""
    if not events_path or not os.path.exists(events_path):
        return None
    faults = [e["time"] for e in read_events(events_path)
              if e["event"] == "fault_injected" and plan["detected_at"] - 60 < e["time"] <= plan["detected_at"]]
    return max(faults) if faults else None


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RecoveryTimelines:
    """A node's part in each recovery's timeline, run by its agent's relay: its
    members' marks (``RecoveryReport``), published as one entry per node in the
    job's store; the node whose entry completes the count (every rank of the job)
    assembles the timeline: the ``recovery`` event (in ``events``), the line
    ``say`` prints, and the recovery's seconds the job's goodput reads
    (``RecoveryReport.finish``). Per node and recovery: two requests, and the
    assembling node three more. ``plan_of(epoch)``: the epoch's plan, as a dict."""

    def __init__(self, kv: KeyValueStore, plan_of: Callable[[int], Dict[str, Any]], nnodes: int, world_size: int,
                 events: Optional[EventLog], say: Callable[[str], None] = _say) -> None:
        self._kv, self._plan_of = kv, plan_of
        self.nnodes, self.world_size = nnodes, world_size
        self._events, self.say = events, say

    def publish(self, epoch: int, node: int, marks: Dict[int, bytes]) -> bool:
        """Publish node ``node``'s members' marks of epoch ``epoch`` (rank -> a member's
        encoded entry); True when this node assembled the timeline."""
        entry = b"{" + b",".join(b'"%d":%s' % (rank, raw) for rank, raw in sorted(marks.items())) + b"}"
        self._kv.set(keys.node_marks(epoch, node), entry)
        if self._kv.add(keys.marks_done(epoch), len(marks)) != self.world_size:
            return False
        self._assemble(epoch)
        return True

    def _assemble(self, epoch: int) -> None:
        plan = self._plan_of(epoch)
        members: Dict[str, Dict[str, Any]] = {}
        for raw in self._kv.get_many([keys.node_marks(epoch, n) for n in range(self.nnodes)]):
            members.update(json.loads(raw) if raw else {})
        marks = {rank: entry["marks"] for rank, entry in members.items()}
        versions = {entry.get("version") for entry in members.values()}
        timeline = recovery_timeline(plan, marks.values(), fault_time(self._events and self._events.path, plan))
        if self._events is not None:
            self._events.write("recovery", **timeline, marks=marks, version=max(versions - {None}, default=None))
        self._kv.set(keys.recovery_seconds(epoch), str(timeline["total_s"]).encode())
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in timeline["phases_s"].items() if v is not None)
        self.say(f"peerstate: recovered epoch {epoch} (ranks {plan['failed']}) in {timeline['total_s']:.2f}s "
                  f"from {timeline['from']}: {phases}")

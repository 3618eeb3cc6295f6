"""The job's event log (JSON lines) and the recovery timeline built from it.

Every process of a node appends to one file, one ``write()`` per line with
O_APPEND, so lines from several processes never interleave. Each line has
``time`` (seconds since the epoch), ``event`` and ``source`` (who wrote it).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Iterable, List, Optional

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

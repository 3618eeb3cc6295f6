"""Hung workers kept frozen for their replacements, so that nothing a hung
worker holds is declared lost.

A hung worker's memory still holds its own snapshot and the replicas it keeps
for its buddies. Instead of killing it at once, its agent stops it (SIGSTOP:
a stalled worker whose threads still run keeps still while it is read) and
names it in the node channel (``keys.stopped_holder``); its replacement, a
spare of the same node, reads both from its memory (``replication.
stopped_holder``) and then releases it (``keys.stopped_holder_released``),
and only then is it killed. One whose replacement is on another node (that
one cannot read it) is killed at the end of its hold; one with no index yet
(no rank) is killed at once.
"""

from __future__ import annotations

import signal
import time
from typing import Dict

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog
from peerstate.launcher.processes import WorkerProcess

# Longest a frozen worker waits for its replacement to release it. A replacement reads it
# during its join, a second or two after the hang is declared; one that has not by then
# is on another node, or the recovery moved on without it.
HOLD_SECONDS = 10.0


class StoppedWorkers:
    """The node's hung workers that are frozen, not yet killed. ``channel`` is the node
    channel the agent hosts (its own connection: used from the agent's watch loop only)."""

    def __init__(self, channel: KeyValueStore, events: EventLog, hold_seconds: float = HOLD_SECONDS) -> None:
        self.channel = channel
        self.events = events
        self.hold_seconds = hold_seconds
        self._held: Dict[int, tuple] = {}  # pid -> (process, kill deadline)

    def freeze(self, process: WorkerProcess) -> bool:
        """Stop hung ``process`` and name it for its replacement, when it published an
        index (it has a rank and stores). Returns whether it did; if not, the caller
        kills it. Frozen even with no spare of the node waiting: the planner waits for
        one, and this node's is refilled first."""
        address = process.counter.index_address()
        if not address or process.rank is None:
            return False
        pid = process.popen.pid
        if not process.signal_group(signal.SIGSTOP):
            return False
        process.held = True
        self._held[pid] = (process, time.monotonic() + self.hold_seconds)
        self.channel.set(keys.stopped_holder(process.rank), f"{pid}:{address}".encode())
        self.events.write("hung_worker_frozen", worker=process.worker, rank=process.rank, pid=pid)
        return True

    def kill_released(self, now: float) -> None:
        """Kill each frozen worker its replacement released, or that waited past its hold
        (reaped, and its exit ignored, by the agent's next poll: see ``forget``)."""
        if not self._held:
            return
        released = self.channel.get_many([keys.stopped_holder_released(pid) for pid in self._held])
        for (pid, (process, deadline)), flag in zip(list(self._held.items()), released):
            if flag is None and now < deadline:
                continue
            self.channel.set(keys.stopped_holder(process.rank), b"")  # a later replacement of the rank reads none
            self.events.write("hung_worker_killed", worker=process.worker, rank=process.rank, pid=pid,
                              released=flag is not None)
            process.signal_group(signal.SIGKILL)
            del self._held[pid]

    def forget(self, process: WorkerProcess) -> bool:
        """Whether ``process`` (just exited) was frozen here: its failure was reported when
        it was frozen, so its exit is not a new one."""
        self._held.pop(process.popen.pid, None)
        return process.held


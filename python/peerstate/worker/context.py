"""What the parts of one worker share (``WorkerContext``), handed to each part
when it is built instead of wired into it afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog
from peerstate.replication.endpoint import Replication
from peerstate.replication.placement import BuddyPlacement
from peerstate.worker.membership import EpochWatcher, Membership
from peerstate.worker.report import RecoveryReport


@dataclass
class WorkerContext:
    """One worker's place in the job and the services its parts share. ``Job``
    builds it; ``replication`` and ``watcher`` are set once, when the process
    takes a rank (a spare's come later), and every part reads them here: none
    keeps a copy of its own."""

    membership: Membership
    kv: KeyValueStore       # the job's store: process-group rendezvous and the few requests docs/recovery.md lists
    channel: KeyValueStore  # the node channel: reports, instructions and the job's failure, through the agent
    coordinator: Coordinator
    events: EventLog
    report: RecoveryReport
    placement: BuddyPlacement
    world_size: int
    join_timeout: float     # the longest wait for the other members (Job(join_timeout=...))
    failure_grace: float    # how long a step's failure waits for its cause to be declared
    replication: Optional[Replication] = None
    watcher: Optional[EpochWatcher] = None

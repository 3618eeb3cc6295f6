"""What the parts of one worker share (``WorkerContext``), handed to each part
when it is built instead of wired into it afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, TypeVar, Union

from peerstate.control.coordinator import Coordinator
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog
from peerstate.errors import InternalError
from peerstate.replication.endpoint import Replication
from peerstate.replication.parity import ParityPlacement
from peerstate.replication.placement import BuddyPlacement
from peerstate.worker.membership import EpochWatcher, Membership
from peerstate.worker.report import RecoveryReport

_Service = TypeVar("_Service")


@dataclass
class WorkerContext:
    """One worker's place in the job and the services its parts share. ``Job``
    builds it and hands it to every part it builds; none keeps a copy of what is
    here. The two services that need a rank come when the process takes one (a
    spare's later): ``serve`` hands over the replication endpoint and ``watch``
    the epoch watcher, once each. Reading either before it came, or handing it
    over twice, is an ``InternalError``: a part that did would act for a rank the
    process does not hold."""

    membership: Membership
    kv: KeyValueStore       # the job's store: process-group rendezvous and the few requests docs/recovery.md lists
    channel: KeyValueStore  # the node channel: reports, instructions and the job's failure, through the agent
    coordinator: Coordinator
    events: EventLog
    report: RecoveryReport
    placement: Union[BuddyPlacement, ParityPlacement]
    world_size: int
    join_timeout: float     # the longest wait for the other members (Job(join_timeout=...))
    failure_grace: float    # how long a step's failure waits for its cause to be declared
    _replication: Optional[Replication] = field(default=None, init=False, repr=False)
    _watcher: Optional[EpochWatcher] = field(default=None, init=False, repr=False)

    @property
    def ranked(self) -> bool:
        """Whether the process took its rank (its replication endpoint came)."""
        return self._replication is not None

    @property
    def replication(self) -> Replication:
        return _came(self._replication, "the replication endpoint")

    @property
    def watcher(self) -> EpochWatcher:
        return _came(self._watcher, "the epoch watcher")

    def serve(self, replication: Replication) -> None:
        """The rank's replication endpoint, from now on (once)."""
        self._replication = _once(self._replication, replication, "the replication endpoint")

    def watch(self, watcher: EpochWatcher) -> None:
        """The watcher of the epochs this rank joins, from now on (once)."""
        self._watcher = _once(self._watcher, watcher, "the epoch watcher")

    def close(self) -> None:
        """Stop the watcher, then close the endpoint (no abort may start while it
        closes); either may not have come."""
        if self._watcher is not None:
            self._watcher.stop()
        if self._replication is not None:
            self._replication.close()


def _came(service: Optional[_Service], what: str) -> _Service:
    if service is None:
        raise InternalError(f"peerstate bug: {what} was used before this process took a rank")
    return service


def _once(held: Optional[_Service], given: _Service, what: str) -> _Service:
    if held is not None:
        raise InternalError(f"peerstate bug: {what} was handed over a second time; a process takes one rank")
    return given

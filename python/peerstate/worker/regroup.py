"""A collective that timed out while every rank is alive: a busy rank, not a dead one.

gloo collectives time out after ``abort_timeout / 2`` (``process_groups`` says
why they must time out at all). A rank that spends longer than that outside
the collectives its peers wait in (an evaluation or a checkpoint save on rank
0, a compile) makes their collective fail, with nobody dead. Raising the error
would stop healthy ranks. Instead, once ``failure_grace`` has passed without a
declared failure, the member that timed out asks for a regroup: an epoch with
the same members (``Coordinator.regroup``) in which everyone rolls back to the
last step all hold and re-forms its groups, with the collective timeout
doubled, which the plan carries to every member, replacements included. The
replayed step then fits. Each regroup is said on stderr and in the event log,
naming ``abort_timeout``, the knob that avoids the replay. After
``MAX_DOUBLINGS`` the job stops instead: a rank that keeps its peers waiting
that long while its heartbeat ticks is stuck, not busy.
"""

from __future__ import annotations

import sys
from typing import List

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.timeline import EventLog
from peerstate.errors import JobFailedError
from peerstate.worker.membership import EpochWatcher
from peerstate.worker.process_groups import ProcessGroups

MAX_DOUBLINGS = 3  # the collective timeout grows to 8 x abort_timeout / 2 at most


def is_collective_timeout(error: BaseException) -> bool:
    """gloo's timeout of a collective or a point-to-point operation."""
    return isinstance(error, RuntimeError) and "Timed out waiting" in str(error)


class BusyPeerRegroup:
    """Turns a gloo collective timeout on live ranks into a regroup (see the module
    docstring). ``agent``: this node's agent (it writes the regroup's instructions);
    ``worker``: this process.

    Which rank was waited for: every member whose collective timed out says so
    in the store at once (``note``, one append); the member that asks for the
    regroup, a grace period later, names the ranks that had not: they had not
    reached the collective when the others gave up."""

    def __init__(self, coordinator: Coordinator, groups: ProcessGroups, events: EventLog, agent: str, worker: str,
                 world_size: int, abort_timeout: float, join_timeout: float) -> None:
        self._coordinator = coordinator
        self._groups = groups
        self._events = events
        self._agent = agent
        self._worker = worker
        self._world_size = world_size
        self._abort_timeout = abort_timeout
        self._join_timeout = join_timeout

    def note(self, error: BaseException, epoch: int, rank: int) -> None:
        """Called at once for an error in a step: record a collective timeout."""
        if self._groups.backend == "gloo" and is_collective_timeout(error):
            self._coordinator.kv.append(keys.collective_timeouts(epoch), f"{rank},".encode())

    def _not_timed_out(self, epoch: int) -> List[int]:
        raw = (self._coordinator.kv.get(keys.collective_timeouts(epoch)) or b"").decode()
        timed_out = {int(r) for r in raw.split(",") if r}
        return [r for r in range(self._world_size) if r not in timed_out]

    def after(self, error: BaseException, watcher: EpochWatcher, epoch: int, rank: int, step: int) -> bool:
        """Called for an error in step ``step`` of epoch ``epoch`` once no failure was
        declared within the grace: True when it was a collective timeout and a newer
        epoch began (this member's regroup or another's), so the step is recovered;
        False for any other error. JobFailedError past ``MAX_DOUBLINGS``."""
        if self._groups.backend != "gloo" or not is_collective_timeout(error):
            return False
        if self._coordinator.kv.get(keys.epoch_owner(epoch + 1)) is not None:
            return watcher.wait_newer(epoch, self._join_timeout)  # another member (or a failure) began it
        waited = self._groups.collective_timeout
        base = self._groups.default_collective_timeout
        longer = 2 * waited
        doubled = ", doubled by earlier regroups" if waited > base else ""
        others = self._not_timed_out(epoch)
        waited_for = (f"; ranks {_listed(others)} had not reached it (or given up) when the others timed out"
                      if others else "")
        told = (f"a collective of rank {rank} in step {step} waited {waited:.0f}s, the gloo collective timeout "
                f"(Job(abort_timeout={self._abort_timeout:g}) / 2{doubled}), and no rank failed{waited_for}: a "
                "rank spent longer than that outside the collectives the others waited in (an evaluation, a "
                "checkpoint save or a compile on one rank?)")
        if longer > base * 2 ** MAX_DOUBLINGS:
            message = (f"{told}. It happened {MAX_DOUBLINGS} times, each with twice the timeout: a rank that keeps "
                       "its peers waiting this long while alive is stuck. Raise Job(abort_timeout=...) if it is not.")
            raise JobFailedError(self._coordinator.fail_job(message))
        message = (f"{told}. The job rolls back to the last step every rank holds and goes on with a collective "
                   f"timeout of {longer:.0f}s; raise Job(abort_timeout=...) above twice the longest such wait to "
                   "avoid the replay.")
        self.begin(epoch, rank, message, longer, step=step, waited=waited, not_timed_out=others)
        return watcher.wait_newer(epoch, self._join_timeout)

    def begin(self, epoch: int, rank: int, message: str, collective_timeout: float, **event: object) -> None:
        """Ask for epoch ``epoch + 1`` with the same members and ``collective_timeout``,
        and say ``message`` (the why) where the plan was this member's: another
        member, or a failure, may have begun that epoch first. Does not wait for it."""
        plan = self._coordinator.regroup(epoch, message, writer=self._agent, me=self._worker,
                                         collective_timeout=collective_timeout)
        if plan is not None:
            print(f"peerstate: {message}", file=sys.stderr, flush=True)
            self._events.write("regroup", epoch=plan.epoch, rank=rank, collective_timeout=collective_timeout,
                               **event)


def _listed(ranks: List[int], most: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return f"[{shown}{f', ... ({len(ranks)} in all)' if len(ranks) > most else ''}]"

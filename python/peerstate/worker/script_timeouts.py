"""Process-group timeouts a training script sets after ``Job()``.

Trainers set them once training runs (torchtitan's ``set_pg_timeouts`` after its
first step, through ``torch.distributed.distributed_c10d._set_pg_timeout``; others
with ``ProcessGroup.set_timeout``). With gloo, a group's timeout is what ends the
waits no abort wakes (``process_groups``), so a longer one set by the script would
hold the loop past ``Job(abort_timeout=...)``. Both calls are therefore kept to
``ProcessGroups.script_timeout``: at most peerstate's wait, a shorter one honoured
and kept through re-formations. A call that was cut is said once per process as a
finding (``control.findings``: on ``peerstate run``'s console and in its summary;
``--strict`` stops the job) and every time in the worker's log. Not covered: a
backend object's own ``_set_default_timeout``, which no trainer we know calls.
"""

from __future__ import annotations

import datetime
import functools
import sys
from typing import Any, Callable, Optional

from peerstate.worker.process_groups import ProcessGroups


def claim_pg_timeouts(groups: ProcessGroups, on_first_cut: Callable[[str], None]) -> None:
    """Route the script's timeout calls through ``groups.script_timeout``;
    ``on_first_cut(message)`` is called for the first call whose timeout was cut.
    ``release_pg_timeouts`` undoes it."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    original_set_pg_timeout = _original(c10d._set_pg_timeout)
    original_set_timeout = _original(dist.ProcessGroup.set_timeout)
    said = []

    def kept(call: str, timeout: datetime.timedelta, group: Any) -> datetime.timedelta:
        asked = timeout.total_seconds()
        allowed = groups.script_timeout(group, asked)
        if allowed < asked:
            name = c10d._world.pg_names.get(group, "?")
            message = (f"{call}({asked:g}s) on process group {name!r} was kept at {allowed:g}s: a gloo collective "
                       f"that waits longer can hold the training loop past Job(abort_timeout=...), where peerstate "
                       f"gives up on a recovery. Raise Job(abort_timeout=...) to let collectives wait longer.")
            print(f"peerstate: {message}", file=sys.stderr, flush=True)
            if not said:
                said.append(message)
                on_first_cut(message)
        return datetime.timedelta(seconds=allowed)

    @functools.wraps(original_set_pg_timeout)
    def set_pg_timeout(timeout: datetime.timedelta, group: Optional[Any] = None) -> None:
        target = c10d._get_default_group() if group is None else group
        original_set_pg_timeout(kept("torch.distributed.distributed_c10d._set_pg_timeout", timeout, target), group)

    @functools.wraps(original_set_timeout)
    def set_timeout(self: Any, timeout: datetime.timedelta) -> None:
        original_set_timeout(self, kept("ProcessGroup.set_timeout", timeout, self))

    set_pg_timeout.__wrapped_by_peerstate__ = original_set_pg_timeout
    set_timeout.__wrapped_by_peerstate__ = original_set_timeout
    c10d._set_pg_timeout = set_pg_timeout
    dist.ProcessGroup.set_timeout = set_timeout


def release_pg_timeouts() -> None:
    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout = _original(dist.distributed_c10d._set_pg_timeout)
    dist.ProcessGroup.set_timeout = _original(dist.ProcessGroup.set_timeout)


def _original(function: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(function, "__wrapped_by_peerstate__", function)

"""Process-group timeouts a training script sets after ``Job()``.

Trainers set them once training runs (torchtitan's ``set_pg_timeouts`` after its
first step: ``torch.distributed.set_timeout`` from torch 2.14, ``_set_pg_timeout``
before; others ``ProcessGroup.set_timeout``). With gloo, a group's timeout is what
ends the waits no abort wakes (``process_groups``), so a longer one set by the
script would hold the loop past ``Job(abort_timeout=...)``. Every one of these
calls is therefore kept to ``ProcessGroups.script_timeout``: at most peerstate's
wait, a shorter one honoured and kept through re-formations. A call that was cut
is said once per process as a finding (``control.findings``: on ``peerstate
run``'s console and in its summary; ``--strict`` stops the job) and every time in
the worker's log. Not covered: a backend object's own ``_set_default_timeout``,
which no trainer we know calls.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import inspect
import sys
from typing import Any, Callable, List, Optional, Tuple

from peerstate.worker import torch_private
from peerstate.worker.process_groups import ProcessGroups, passing_timeout_calls, timeout_calls_pass

# The functions (timeout, group=None) a script sets a group's timeout with, where this torch has them.
_FUNCTIONS = (("torch.distributed", "set_timeout"), ("torch.distributed.distributed_c10d", "set_timeout"),
              ("torch.distributed.distributed_c10d", "_set_pg_timeout"))


def claim_pg_timeouts(groups: ProcessGroups, on_first_cut: Callable[[str], None]) -> None:
    """Route the script's timeout calls through ``groups.script_timeout``;
    ``on_first_cut(message)`` is called for the first call whose timeout was cut.
    ``release_pg_timeouts`` undoes it."""
    import torch.distributed as dist

    said: List[str] = []

    def kept(call: str, timeout: datetime.timedelta, group: Any) -> datetime.timedelta:
        asked = timeout.total_seconds()
        allowed = groups.script_timeout(group, asked)
        if allowed < asked:
            name = torch_private.group_names().get(group, "?")
            message = (f"{call}({asked:g}s) on process group {name!r} was kept at {allowed:g}s: a gloo collective "
                       f"that waits longer can hold the training loop past Job(abort_timeout=...), where peerstate "
                       f"gives up on a recovery. Raise Job(abort_timeout=...) to let collectives wait longer.")
            print(f"peerstate: {message}", file=sys.stderr, flush=True)
            if not said:
                said.append(message)
                on_first_cut(message)
        return datetime.timedelta(seconds=allowed)

    def function(original: Callable[..., None], call: str) -> Callable[..., None]:
        @functools.wraps(original)
        def set_timeout(timeout: datetime.timedelta, group: Optional[Any] = None) -> None:
            if timeout_calls_pass():
                return original(timeout, group)
            target = torch_private.default_group() if group is None else group
            allowed = kept(call, timeout, target)
            with passing_timeout_calls():
                return original(allowed, group)
        return set_timeout

    def method(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def set_timeout(self: Any, timeout: datetime.timedelta) -> None:
            if timeout_calls_pass():
                return original(self, timeout)
            allowed = kept("ProcessGroup.set_timeout", timeout, self)
            with passing_timeout_calls():
                return original(self, allowed)
        return set_timeout

    for owner, name, original in _present():
        wrapper = (method(original) if owner is dist.ProcessGroup
                   else function(original, f"{owner.__name__}.{name}"))
        wrapper.__wrapped_by_peerstate__ = original
        setattr(owner, name, wrapper)


def release_pg_timeouts() -> None:
    for owner, name, original in _present():
        setattr(owner, name, original)


def _present() -> List[Tuple[Any, str, Callable[..., Any]]]:
    """(owner, name, torch's own function) of every timeout call this torch has."""
    import torch.distributed as dist

    owners = [(importlib.import_module(module), name) for module, name in _FUNCTIONS]
    owners.append((dist.ProcessGroup, "set_timeout"))
    present = []
    for owner, name in owners:
        # As stored, not as looked up: from torch 2.14 (its pybind11) a method read off the class
        # is a plain builtin, which set back on the class would no longer bind `self`.
        found = inspect.getattr_static(owner, name, None)
        if found is not None:
            present.append((owner, name, getattr(found, "__wrapped_by_peerstate__", found)))
    return present

"""Whether the kernel runs a process at all: the evidence behind "frozen".

A worker's liveness count (``control.progress``) standing still says only that
its ticker thread was not scheduled for a while. The process may be:

- stopped: SIGSTOP, job control or a debugger (a thread in state ``T`` or ``t``
  in ``/proc/PID/task/TID/stat``);
- frozen by its cgroup: cgroup v1's ``freezer.state`` is ``FROZEN`` or
  ``FREEZING`` (it reports a frozen ancestor too), v2's ``cgroup.freeze`` is 1
  or ``cgroup.events`` says ``frozen 1`` (an ancestor's freeze);
- or merely not scheduled: runnable on a starved node, throttled by its CPU
  quota (CFS bandwidth under a Kubernetes CPU limit), in a page-fault storm, or
  exiting (``do_exit`` ends every thread before it frees the memory).

Only the first two are frozen: the kernel will not run the process until
someone lets it. The rest is a live process that is slow, bounded like any other
by the heartbeat's ``--hang-timeout`` (``launcher.processes.WorkerProcess``).
Each look reads a few small files, and is made only once the count stood still.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

# Where this machine has /proc, the kernel is asked; elsewhere a count that stood still is all there is.
AVAILABLE = os.path.exists("/proc/self/stat")
_STOPPED_STATES = {b"T": "stopped by a signal", b"t": "stopped by a debugger"}


def frozen(pid: int) -> Optional[str]:
    """Why the kernel does not run ``pid`` ("stopped by a signal, state T", "frozen
    by its cgroup PATH, FROZEN"), or None when it does, may, or the process is gone (waitpid says
    how it ended). Never raises for a process that vanishes while it is read."""
    stopped = _stopped_thread(pid)
    return stopped if stopped else _frozen_cgroup(pid)


def _stopped_thread(pid: int) -> Optional[str]:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # that thread ended
        state = stat[stat.rfind(b")") + 2:][:1]  # the name, in parentheses, may hold anything
        if state in _STOPPED_STATES:
            return f"{_STOPPED_STATES[state]}, state {state.decode()}"
    return None


def _frozen_cgroup(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mounts = _cgroup_mounts()
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and "cgroup2" in mounts:
            directory = _join(mounts["cgroup2"], path)
            if _read(directory, "cgroup.freeze") == "1" or "frozen 1" in _read(directory, "cgroup.events").split("\n"):
                return f"frozen by its cgroup {directory}"
        elif "freezer" in controllers.split(",") and "freezer" in mounts:
            directory = _join(mounts["freezer"], path)
            state = _read(directory, "freezer.state")
            if state in ("FROZEN", "FREEZING"):
                return f"frozen by its cgroup {directory}, {state}"
    return None


def _cgroup_mounts() -> Dict[str, tuple]:
    """The freezer's v1 hierarchy and the v2 hierarchy, each as (mount point, the
    cgroup path mounted there), from this process's mount table (a node's agent
    shares its workers' mount namespace)."""
    mounts: Dict[str, tuple] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            table = f.read().splitlines()
    except OSError:
        return mounts
    for entry in table:
        fields = entry.split()
        if "-" not in fields:
            continue
        tail = fields[fields.index("-") + 1:]
        root, point, fstype = fields[3], fields[4], tail[0]
        if fstype == "cgroup2":
            mounts.setdefault("cgroup2", (point, root))
        elif fstype == "cgroup" and len(tail) > 2 and "freezer" in tail[2].split(","):
            mounts.setdefault("freezer", (point, root))
    return mounts


def _join(mount: tuple, path: str) -> str:
    point, root = mount
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


def _read(directory: str, name: str) -> str:
    try:
        with open(os.path.join(directory, name)) as f:
            return f.read().strip()
    except OSError:
        return ""

"""The processes a node agent starts: how each is watched (``ExitWatch`` sees a
death before ``waitpid`` can), and the helpers that describe how one ended."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from peerstate.control import progress
from peerstate.control.progress import ProgressCounter
from peerstate.launcher import kernel_state


# How a worker killed as hung is described (``WorkerProcess.hung``): its Python heartbeat
# stood still past its bound, or its native liveness count did and the kernel does not run
# it (see control.progress and kernel_state; ``WorkerProcess.frozen`` says how it was frozen).
HANG_CAUSES = {"stalled": "hung (its progress counter stopped) and was killed",
               "frozen": "hung: frozen ({frozen}) and was killed"}
# The same, for one frozen for its replacement to read before it is killed (launcher.stopped_workers).
HANG_HELD = {"stalled": "hung (its progress counter stopped): stopped for its replacement to read, then killed",
             "frozen": "hung: frozen ({frozen}), kept for its replacement to read, then killed"}


class WorkerProcess:
    """One process this agent started: an initial worker, or a spare until it is given a rank."""

    def __init__(self, worker: str, rank: Optional[int], popen: subprocess.Popen, counter: ProgressCounter,
                 log: Path) -> None:
        self.worker = worker
        self.rank = rank                   # None while a spare waits
        self.popen = popen
        self.counter = counter
        self.log = log
        self.heartbeat = 0
        self.heartbeat_at = time.monotonic()
        self.liveness = 0                  # the native count (see control.progress)
        self.liveness_at = time.monotonic()
        self.ticked = False                # it reached peerstate.Job()
        self.hung: Optional[str] = None   # why it was killed as hung: 'stalled' or 'frozen'
        self.frozen: Optional[str] = None  # what the kernel said of it when it was found frozen
        self.held = False                  # hung, and frozen for its replacement (launcher.stopped_workers)
        self.claimed = False               # a spare a planner claimed, not yet named by a plan
        self.ready = False                 # a spare in the pool (its script reached track())
        self.exit_watch = ExitWatch(popen.pid)

    def read_progress(self, now: float, hang_timeout: float, join_timeout: float,
                      freeze_timeout: float) -> Optional[str]:
        """Read its progress counter at ``now``: the cause (a key of ``HANG_CAUSES``)
        when it is hung, else None. Its Python heartbeat is bounded by ``hang_timeout``
        in the loop, and by ``join_timeout`` before its first step, while it recovers
        (``progress.SETUP`` says why) and once it closed its job without finishing
        (``progress.EXITING``), as nvidia-resiliency-ext bounds the first
        heartbeat apart from the later ones. Its native liveness count is bounded by
        ``freeze_timeout`` (or ``hang_timeout`` if shorter) throughout, and a count that
        stood still that long is judged by the kernel (``kernel_state.frozen``): stopped or
        cgroup-frozen is frozen, found in a few of its intervals, in its loop as while it
        recovers, before its peers' group formation gives up on it; runnable but not
        scheduled (a starved node, a CPU quota) or exiting is not, and is left to the
        heartbeat's bound. Not before it reached peerstate.Job(), nor once it finished
        its loop."""
        heartbeat, step, liveness = self.counter.read()
        if heartbeat != self.heartbeat:
            self.heartbeat, self.heartbeat_at, self.ticked = heartbeat, now, True
        if liveness != self.liveness:
            self.liveness, self.liveness_at = liveness, now
        if not self.ticked or step == progress.FINISHED:
            return None
        if self.liveness > 0 and now - self.liveness_at > min(freeze_timeout, hang_timeout):
            self.frozen = kernel_state.frozen(self.popen.pid) if kernel_state.AVAILABLE else \
                "its liveness count stopped; no /proc to ask the kernel"
            if self.frozen:
                return "frozen"
        bound = hang_timeout if step >= 0 else max(hang_timeout, join_timeout)
        return "stalled" if now - self.heartbeat_at > bound else None

    def describe_hang(self, held: bool = False) -> str:
        """How it hung, for its exit and its report (``HANG_CAUSES``, ``HANG_HELD``)."""
        return (HANG_HELD if held else HANG_CAUSES)[self.hung].format(frozen=self.frozen)

    def signal_group(self, signum: int) -> bool:
        """Send ``signum`` to its process group (its script and whatever the script started).
        Returns False when the group is gone: it died, and was maybe reaped, since the
        agent last looked, a race every caller must survive (its exit is reported by the
        agent's next poll), not an error."""
        try:
            os.killpg(self.popen.pid, signum)
        except ProcessLookupError:
            return False
        return True


# Linux's PF_EXITING: set on a task as it enters do_exit(), before its memory is released.
_PF_EXITING = 0x4


class ExitWatch:
    """Sees a child process begin to exit abnormally, before ``waitpid`` can.

    The kernel records the exit status and marks the task exiting as it enters
    do_exit(), then releases the process's memory, and only then lets ``waitpid``
    see it. For a worker holding a few hundred MiB (tensors plus snapshot memory)
    that release takes 50-80 ms on a busy core; ``/proc/PID/stat`` (fields 9,
    flags, and 52, exit_code) shows the death that much sooner. The file stays
    open: a look is one pread (~3 us against ~9 us to open it each time, at a
    look per worker every 5 ms)."""

    def __init__(self, pid: int) -> None:
        try:
            self._fd: Optional[int] = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        except OSError:
            self._fd = None  # no /proc, or already reaped: waitpid alone will tell

    def status(self) -> Optional[int]:
        """The exit status in ``Popen.returncode`` form once the process has begun to
        exit by a signal or a non-zero code; None while it runs or is stopped, when it
        exits with 0 (no failure: left to waitpid), or where /proc does not say."""
        if self._fd is None:
            return None
        try:
            stat = os.pread(self._fd, 1024, 0)
        except OSError:
            return None  # reaped
        fields = stat[stat.rfind(b")") + 2:].split()  # fields from 3 (state) on; the name may hold spaces
        if len(fields) < 50 or not int(fields[9 - 3]) & _PF_EXITING:
            return None
        code = int(fields[52 - 3])
        if code == 0:
            return None
        return -(code & 0x7F) if code & 0x7F else (code >> 8) & 0xFF

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def die_with_parent() -> None:
    """In the child: SIGKILL when the agent dies, so a lost node takes its workers along."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def remove_stale_counters(directory: Path) -> int:
    """Remove the progress counters (``peerstate-{agent pid}-{worker}.progress``) of
    agents no longer alive: an agent killed with SIGKILL (its node lost, a test's
    kill-node) cannot remove its own, and in /dev/shm they would stay until a reboot.
    A live pid keeps its files (another agent on this machine, or a pid reused).
    Returns how many were removed."""
    removed = 0
    for path in directory.glob("peerstate-*-*.progress"):
        pid = path.name.split("-")[1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass  # another agent removed it first
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True

"""A worker's progress counter in shared memory, watched by its node agent.

Four 64-bit words in a small file the agent creates (under /dev/shm when it
exists): a heartbeat the worker's Python ticker thread bumps every
``interval`` seconds, the last completed step, a liveness count a native
thread bumps at the same pace (``_C.LivenessTicker``), and the address of the
worker's ``_C.ProcessIndex`` (0 until it has one): where its replacement
finds its stores if it hangs (``replication.stopped_holder``). A frozen process
(SIGSTOP, a cgroup freeze) stops both, and so does a starved one for as long as
it waits for a CPU: the agent asks the kernel which it is before it calls a
stopped count frozen (``launcher.kernel_state``). An interpreter stuck in a
native call that holds the GIL stops the first only; a rank that is merely
blocked in a collective on a frozen peer keeps both ticking, so only the frozen
rank is blamed. The liveness count ticks until the process is gone, through
the interpreter's teardown. The agent bounds each phase by what can stall it
(``launcher.processes.WorkerProcess.read_progress``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import signal
import struct
import threading
from typing import Iterator, Optional

from peerstate.control.environment import STACKS_SIGNAL

_FORMAT = "<QqQ"
_INDEX_OFFSET = struct.calcsize(_FORMAT)
SIZE = _INDEX_OFFSET + 8
FINISHED = -2  # the step word once the worker has finished: it is no longer watched
# The step word while a worker that has stepped recovers. Until its first step, and
# while recovering, the agent bounds a stalled heartbeat by --join-timeout instead of
# --hang-timeout: torch's setup collectives (DDP's parameter check, a group's connect)
# hold the GIL while they wait for a slower peer, which stops a healthy worker's
# ticker thread; those phases are bounded by their own timeouts. The liveness count
# is bounded by --freeze-timeout in every phase, the kernel's word deciding (see above).
SETUP = -3
# The step word once a worker closed its job without finishing its loop (an error left
# it): the interpreter's teardown with torch loaded takes a second or more after the
# Python heartbeat stops, so its exit is bounded by --join-timeout, not --hang-timeout
# (a worker exiting on an exception was killed as hung, hiding how it ended). The
# liveness count still bounds a frozen one by --freeze-timeout.
EXITING = -4
_LIVENESS_OFFSET = 16
# How often both tickers bump their counts. A native thread that only sleeps and stores
# is late by scheduling delays of milliseconds, so a liveness count that stood still for
# a few intervals means the whole process is stopped (launcher.config.AgentConfig's
# freeze_timeout is at least FREEZE_INTERVALS of them).
TICK_SECONDS = 0.1
FREEZE_INTERVALS = 3


def create(path: str) -> None:
    """Create a counter file (agent side): no heartbeat yet, no step finished."""
    with open(path, "wb") as f:
        f.write(struct.pack(_FORMAT + "Q", 0, -1, 0, 0))


class ProgressCounter:
    """One worker's counter (both sides map the same file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._ticker: Optional[threading.Thread] = None
        self._liveness = None
        self._stop = threading.Event()

    def read(self) -> tuple:
        """(heartbeat, step, liveness)."""
        return struct.unpack_from(_FORMAT, self._map, 0)

    def index_address(self) -> int:
        """Where the worker's ProcessIndex lies in its memory (0: none)."""
        return struct.unpack_from("<Q", self._map, _INDEX_OFFSET)[0]

    def set_index_address(self, address: int) -> None:
        struct.pack_into("<Q", self._map, _INDEX_OFFSET, address)

    def set_step(self, step: int) -> None:
        struct.pack_into("<q", self._map, 8, step)

    def start_ticking(self, interval: float = TICK_SECONDS) -> None:
        """Start both tickers (worker side), the native one first: the agent reads a
        Python heartbeat as the sign that the liveness count runs too."""
        from peerstate import _C

        # Before the first heartbeat, by which the agent knows it may ask (environment.STACKS_SIGNAL).
        # fd 2 is the worker's log, whatever the script makes of sys.stderr. A handler the script
        # set before is called after the dump; the default action (the end of the process) is not.
        chain = signal.getsignal(STACKS_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True, chain=chain)
        self._liveness = _C.LivenessTicker(self.path, _LIVENESS_OFFSET, interval)

        def bump() -> None:
            struct.pack_into("<Q", self._map, 0, struct.unpack_from("<Q", self._map, 0)[0] + 1)

        def tick() -> None:
            while not self._stop.wait(interval):
                bump()

        # At once, not an interval later: the first heartbeat is how the agent knows the
        # script reached peerstate.Job(), and a spare that fails right after it (a script
        # reading RANK too early) must not be taken for one that never got there.
        bump()
        self._ticker = threading.Thread(target=tick, name="peerstate-progress", daemon=True)
        self._ticker.start()

    @contextlib.contextmanager
    def setting_up(self) -> Iterator[None]:
        """Mark a recovery (see ``SETUP``); the step it finished before is set back after."""
        previous = self.read()[1]
        self.set_step(SETUP)
        try:
            yield
        finally:
            if self.read()[1] == SETUP:
                self.set_step(previous)

    def finish(self) -> None:
        """Mark the worker done: from here to its exit it is not watched for hangs."""
        self.set_step(FINISHED)

    def exiting(self) -> None:
        """Mark a worker that leaves without finishing (see ``EXITING``); a finished one
        stays finished."""
        if self.read()[1] != FINISHED:
            self.set_step(EXITING)

    def close(self) -> None:
        """Stop the Python heartbeat. The liveness count runs on until the process is
        gone, even once this object is freed (``_C.LivenessTicker``): a worker whose exit
        takes a while is exiting, not frozen (its agent then reports how it ended)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()

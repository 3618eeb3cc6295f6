"""The agent's side of ``--inject``: lands this node's due faults on its processes.

``FaultInjector`` (``launcher.inject``) says which faults are due; this part
claims each in the job's store (a fault lands once, even when its rank has
moved to another node since the schedule was drawn), logs it as a
``fault_injected`` event before it lands (recovery timelines measure from
it), and sends the signal: SIGKILL to the victim's process group, SIGSTOP for
a hang, and for a node kill every process the agent runs, then the agent.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Dict, Optional

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog
from peerstate.launcher.inject import Fault, FaultInjector
from peerstate.launcher.processes import WorkerProcess


class FaultDelivery:
    """Delivers ``injector``'s faults for the agent named ``me``. ``deliver()`` is
    called from the agent's watch loop; it blocks only on the store's claims."""

    def __init__(self, injector: FaultInjector, kv: KeyValueStore, me: str, events: EventLog) -> None:
        self.injector = injector
        self._kv = kv
        self._me = me.encode()
        self._events = events
        self._job_started: Optional[float] = None  # wall clock of the job's first step, once published

    def deliver(self, processes: Dict[str, WorkerProcess]) -> None:
        """Land every fault due now on ``processes`` (this agent's, by worker name).
        A node kill does not return."""
        if not self.injector.faults:
            return
        workers = {p.rank: p for p in processes.values() if p.rank is not None and not p.hung}
        if self._job_started is None:
            raw = self._kv.get(keys.JOB_STARTED)
            self._job_started = float(raw) if raw else None
        since = time.time() - self._job_started if self._job_started else None
        spares = [p for p in processes.values() if p.rank is None and not p.claimed and p.ready]
        for fault in self.injector.due({r: p.counter.read()[1] for r, p in workers.items()}, since, len(spares)):
            if self._kv.compare_set(keys.injected(fault.index), b"", self._me) != self._me:
                continue  # injected already, on the node that held the rank then
            self._land(fault, spares[0] if fault.kind == "kill-spare" else workers.get(fault.rank), processes)

    def _land(self, fault: Fault, victim: Optional[WorkerProcess], processes: Dict[str, WorkerProcess]) -> None:
        self._events.write("fault_injected", fault=fault.describe(), kind=fault.kind, rank=fault.rank,
                           node=fault.node, scenario=fault.scenario, scenario_kind=fault.scenario_kind,
                           worker=victim.worker if victim is not None else None)
        print(f"peerstate: injecting {fault.describe()}", file=sys.stderr, flush=True)
        if fault.kind == "kill-node":  # everything this agent runs, then the agent itself
            for process in processes.values():
                process.signal_group(signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        victim.signal_group(signal.SIGSTOP if fault.kind == "hang" else signal.SIGKILL)

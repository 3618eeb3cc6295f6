"""Fault injection for any job started by ``peerstate run`` (``--inject SPEC``).

A spec names what, whom and when::

    kill:rank=2:step=10          SIGKILL the process holding rank 2 once it finished step 10
    hang:rank=1:time=30          SIGSTOP rank 1, 30 s after the job's first step
    kill-node:node=1:step=20     SIGKILL node 1's agent and everything it runs (a lost node)
    random:mtbf=20:seed=7:max=3  failures at exponential intervals (mean 20 s) drawn from the
                                 seed: kinds and victims too (add kinds=kill,hang,kill-node
                                 and world=N/nodes=M to choose); reproducible, at most max

Every agent parses the same specs and acts only on its own processes (the
agent of node n performs kill-node on n), so one command line serves all
nodes. Each fault is logged as a ``fault_injected`` event before it lands, so
recovery timelines measure from the fault itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional

from peerstate.errors import InvalidArgumentError

KINDS = ("kill", "hang", "kill-node")


@dataclass
class Fault:
    kind: str                 # kill | hang | kill-node
    rank: Optional[int] = None
    node: Optional[int] = None
    step: Optional[int] = None
    time: Optional[float] = None  # seconds after the job's first step
    index: int = 0                # position in the job's schedule, the same on every node
    done: bool = False

    def describe(self) -> str:
        whom = f"node {self.node}" if self.kind == "kill-node" else f"rank {self.rank}"
        when = f"after step {self.step}" if self.step is not None else f"at {self.time:.1f}s"
        return f"{self.kind} {whom} {when}"


def parse(spec: str, *, world_size: int, nnodes: int) -> List[Fault]:
    """The faults of one ``--inject`` spec (several for ``random``)."""
    kind, _, rest = spec.partition(":")
    fields: Dict[str, str] = {}
    for item in filter(None, rest.split(":")):
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgumentError(f"--inject {spec!r}: {item!r} is not key=value")
        fields[key] = value
    try:
        if kind == "random":
            return _random_schedule(fields, world_size, nnodes)
        if kind not in KINDS:
            raise InvalidArgumentError(f"--inject {spec!r}: the kind must be one of {', '.join(KINDS)} or random")
        fault = Fault(kind, step=_int(fields, "step"), time=_float(fields, "time"))
        if (fault.step is None) == (fault.time is None):
            raise InvalidArgumentError(f"--inject {spec!r}: give exactly one of step=N or time=SECONDS")
        if kind == "kill-node":
            fault.node = _int(fields, "node")
            if fault.node is None or not 0 <= fault.node < nnodes:
                raise InvalidArgumentError(f"--inject {spec!r}: node=N with N in 0..{nnodes - 1}")
        else:
            fault.rank = _int(fields, "rank")
            if fault.rank is None or not 0 <= fault.rank < world_size:
                raise InvalidArgumentError(f"--inject {spec!r}: rank=R with R in 0..{world_size - 1}")
        return [fault]
    except ValueError as error:
        raise InvalidArgumentError(f"--inject {spec!r}: {error}") from None


def _int(fields: Dict[str, str], key: str) -> Optional[int]:
    return int(fields[key]) if key in fields else None


def _float(fields: Dict[str, str], key: str) -> Optional[float]:
    return float(fields[key]) if key in fields else None


def _random_schedule(fields: Dict[str, str], world_size: int, nnodes: int) -> List[Fault]:
    mtbf = _float(fields, "mtbf")
    if mtbf is None or mtbf <= 0:
        raise InvalidArgumentError("--inject random needs mtbf=SECONDS > 0")
    count = _int(fields, "max") or 3
    kinds = fields.get("kinds", "kill,hang").split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise InvalidArgumentError(f"--inject random: unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    draw = random.Random(_int(fields, "seed") or 0)
    faults, at = [], 0.0
    for _ in range(count):
        at += draw.expovariate(1.0 / mtbf)
        kind = draw.choice(kinds)
        if kind == "kill-node":
            faults.append(Fault(kind, node=draw.randrange(nnodes), time=at))
        else:
            faults.append(Fault(kind, rank=draw.randrange(world_size), time=at))
    return faults


class FaultInjector:
    """The faults an agent still has to inject; ``due()`` says which are due now.
    The agent claims each in the job's store before injecting it, so a fault
    lands once even when its rank moves to another node."""

    def __init__(self, specs: List[str], *, world_size: int, nnodes: int, node: int) -> None:
        self.faults = [f for spec in specs for f in parse(spec, world_size=world_size, nnodes=nnodes)]
        for index, fault in enumerate(self.faults):
            fault.index = index
        self.node = node

    def due(self, steps_by_rank: Dict[int, int], seconds_since_start: Optional[float]) -> List[Fault]:
        """Faults this node must inject now. ``steps_by_rank``: the last finished step
        of each rank this node runs; ``seconds_since_start``: None before the first step."""
        ready = []
        for fault in self.faults:
            if fault.done:
                continue
            if fault.kind == "kill-node":
                if fault.node != self.node:
                    continue
                step = max(steps_by_rank.values(), default=-1)
            else:
                if fault.rank not in steps_by_rank:
                    continue
                step = steps_by_rank[fault.rank]
            if fault.step is not None and step >= fault.step:
                ready.append(fault)
            elif fault.time is not None and seconds_since_start is not None and seconds_since_start >= fault.time:
                ready.append(fault)
        for fault in ready:
            fault.done = True
        return ready

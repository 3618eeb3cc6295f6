"""Fault injection for any job started by ``peerstate run`` (``--inject SPEC``).

A spec names what, whom and when::

    kill:rank=2:step=10          SIGKILL the process holding rank 2 once it finished step 10
    hang:rank=1:time=30          SIGSTOP rank 1, 30 s after the job's first step
    kill-node:node=1:step=20     SIGKILL node 1's agent and everything it runs (a lost node)
    kill-spare:node=0:time=12    SIGKILL a hot spare waiting on node 0 (the first one ready after then)
    random:mtbf=20:seed=7:max=3  failures at exponential intervals (mean 20 s) drawn from the
                                 seed: kinds and victims too (add kinds=kill,hang,kill-node
                                 and world=N/nodes=M to choose); reproducible, at most max

Beside the kinds above, ``random`` draws three sequences, each one fault of the
schedule made of two that land together (their victims from the placement
every process computes, ``BuddyPlacement`` with k=1):

    kill-in-recovery             kill a rank, then another 0.05-0.3 s later, inside the recovery
    hang-then-kill-buddy         hang a rank, then kill its buddy 0.1-0.35 s later, before the hang is
                                 seen (a frozen worker is found after --freeze-timeout, 0.5 s by default)
    kill-with-buddy              kill a rank and its buddy at once (its state's every copy: a
                                 disk checkpoint is the only way back)

``random`` draws at most ``nodes - 1`` node kills (``max-node-kills`` to change
it): a job whose every node is killed has nothing left to recover on.

Every agent parses the same specs and acts only on its own processes (the
agent of node n performs kill-node and kill-spare on n), so one command line
serves all nodes. Each fault is logged as a ``fault_injected`` event before it
lands (with the fault it belongs to, ``scenario``), so recovery timelines
measure from the fault itself.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

from peerstate.errors import InvalidArgumentError

KINDS = ("kill", "hang", "kill-node", "kill-spare")
SEQUENCES = ("kill-in-recovery", "hang-then-kill-buddy", "kill-with-buddy")  # random only: two faults each


@dataclass
class Fault:
    kind: str                 # kill | hang | kill-node | kill-spare
    rank: Optional[int] = None
    node: Optional[int] = None
    step: Optional[int] = None
    time: Optional[float] = None  # seconds after the job's first step
    index: int = 0                # position in the job's schedule, the same on every node
    scenario: int = 0             # the drawn fault it is part of (a sequence has two), numbered from 0
    scenario_kind: str = ""       # that fault's kind: its own, or the sequence's
    done: bool = False

    def describe(self) -> str:
        whom = f"node {self.node}" if self.kind in ("kill-node", "kill-spare") else f"rank {self.rank}"
        when = f"after step {self.step}" if self.step is not None else f"at {self.time:.2f}s"
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
        fault = Fault(kind, step=_int(fields, "step"), time=_float(fields, "time"), scenario_kind=kind)
        if (fault.step is None) == (fault.time is None):
            raise InvalidArgumentError(f"--inject {spec!r}: give exactly one of step=N or time=SECONDS")
        if kind in ("kill-node", "kill-spare"):
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


def buddies(world_size: int, nnodes: int) -> Dict[int, int]:
    """rank -> its buddy (k=1), as every process of a job of ``nnodes`` equal nodes places it."""
    from peerstate.replication.placement import BuddyPlacement

    nproc = world_size // nnodes
    with warnings.catch_warnings():  # one node: the buddy shares it, which the job itself says
        warnings.simplefilter("ignore")
        placement = BuddyPlacement([r // nproc for r in range(world_size)], k=1)
    return {r: placement.holders(r)[0] for r in range(world_size)}


def _random_schedule(fields: Dict[str, str], world_size: int, nnodes: int) -> List[Fault]:
    mtbf = _float(fields, "mtbf")
    if mtbf is None or mtbf <= 0:
        raise InvalidArgumentError("--inject random needs mtbf=SECONDS > 0")
    count = _int(fields, "max") or 3
    kinds = fields.get("kinds", "kill,hang").split(",")
    unknown = [k for k in kinds if k not in KINDS + SEQUENCES]
    if unknown:
        raise InvalidArgumentError(f"--inject random: unknown kinds {unknown}; choose from "
                                   f"{', '.join(KINDS + SEQUENCES)}")
    node_kills = _int(fields, "max-node-kills")
    node_kills = nnodes - 1 if node_kills is None else node_kills
    buddy = buddies(world_size, nnodes) if any(k in kinds for k in SEQUENCES[1:]) else None
    draw = random.Random(_int(fields, "seed") or 0)
    faults: List[Fault] = []
    at = 0.0
    for scenario in range(count):
        at += draw.expovariate(1.0 / mtbf)
        kind = draw.choice(kinds)
        if kind == "kill-node" and node_kills <= 0:
            kind = "kill"  # no node left to kill: a worker instead, so the schedule keeps its length
        if kind == "kill-node":
            node_kills -= 1
        victim = draw.randrange(world_size)
        if kind in ("kill-node", "kill-spare"):
            drawn = [Fault(kind, node=draw.randrange(nnodes), time=at)]
        elif kind == "kill-in-recovery":
            other = draw.choice([r for r in range(world_size) if r != victim])
            drawn = [Fault("kill", rank=victim, time=at), Fault("kill", rank=other, time=at + draw.uniform(0.05, 0.3))]
        elif kind == "hang-then-kill-buddy":
            drawn = [Fault("hang", rank=victim, time=at),
                     Fault("kill", rank=buddy[victim], time=at + draw.uniform(0.1, 0.35))]
        elif kind == "kill-with-buddy":
            drawn = [Fault("kill", rank=victim, time=at), Fault("kill", rank=buddy[victim], time=at)]
        else:
            drawn = [Fault(kind, rank=victim, time=at)]
        for fault in drawn:
            fault.scenario, fault.scenario_kind = scenario, kind
        faults.extend(drawn)
    return faults


class FaultInjector:
    """The faults an agent still has to inject; ``due()`` says which are due now.
    The agent claims each in the job's store before injecting it, so a fault
    lands once even when its rank moves to another node."""

    def __init__(self, specs: List[str], *, world_size: int, nnodes: int, node: int) -> None:
        self.faults: List[Fault] = []
        for spec in specs:  # scenarios numbered across the specs
            first = max((f.scenario for f in self.faults), default=-1) + 1
            for fault in parse(spec, world_size=world_size, nnodes=nnodes):
                fault.scenario += first
                self.faults.append(fault)
        for index, fault in enumerate(self.faults):
            fault.index = index
        self.node = node

    def due(self, steps_by_rank: Dict[int, int], seconds_since_start: Optional[float],
            spares_waiting: int = 0) -> List[Fault]:
        """Faults this node must inject now. ``steps_by_rank``: the last finished step
        of each rank this node runs; ``seconds_since_start``: None before the first
        step; ``spares_waiting``: its hot spares ready now (a kill-spare waits for one)."""
        ready = []
        for fault in self.faults:
            if fault.done:
                continue
            if fault.kind in ("kill-node", "kill-spare"):
                if fault.node != self.node or (fault.kind == "kill-spare" and not spares_waiting):
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

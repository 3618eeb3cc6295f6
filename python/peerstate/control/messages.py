"""What the control plane's members tell each other through the store, and
what a member is told to do: each message encodes to JSON bytes and decodes
back to the same typed object."""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

Address = Tuple[str, int]


@dataclass
class RecoveryPlan:
    """What changed in one epoch, and why it began.

    Only the change travels (``replaced``: the ranks given to a new worker), so
    a plan's size does not grow with the job. ``members`` (rank -> worker) is
    not encoded: the ``Coordinator`` folds it from epoch 0's layout and every
    plan's ``replaced``, and fills it in the plans it returns."""

    epoch: int
    members: Mapping[int, str] = field(default_factory=dict)  # not encoded (see above)
    replaced: Dict[int, str] = field(default_factory=dict)  # ranks that changed worker this epoch
    failed: List[int] = field(default_factory=list)
    reason: str = ""
    detected_at: float = 0.0
    planned_at: float = 0.0
    writer: str = ""  # the agent that owned the epoch when it wrote the plan (it writes the instructions)
    # Seconds a gloo collective waits from this epoch on (0: the Job's own, abort_timeout / 2). A regroup
    # (a collective timed out on a live, busy rank) doubles it; every other plan carries it over.
    collective_timeout: float = 0.0

    def encode(self) -> bytes:
        data = {k: v for k, v in self.__dict__.items() if k != "members"}  # not asdict: it would copy members first
        return json.dumps(data).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "RecoveryPlan":
        data = json.loads(raw)
        data["replaced"] = {int(r): w for r, w in data["replaced"].items()}
        return cls(**data)


@dataclass
class MemberReport:
    """What one member of an epoch holds, published when it joins the epoch."""

    rank: int
    worker: str
    local: List[int]                 # versions committed in its own SnapshotStore
    replicas: Dict[int, List[int]]   # source rank -> the versions of its replica held here
    address: Address                 # its replication server (its own state, its shares, the replicas)
    needs_state: bool = False        # new in this epoch, or joined earlier and not restored yet
    pid: int = 0
    shared_regions: Dict[int, int] = field(default_factory=dict)  # version -> its address in its share's store
    checkpoint: Optional[Tuple[int, str]] = None  # its newest disk checkpoint (step, directory)
    layout: "StateLayout" = None  # type: ignore[assignment] - how the job's state is placed (below)
    # Versions of its own state its hung predecessor on its node still holds, read from that
    # process's memory (a replacement; see replication.stopped_holder).
    stopped: List[int] = field(default_factory=list)
    # Versions of its own data-parallel share it holds although it needs state: adopted from
    # that predecessor, served like a survivor's.
    adopted_share: List[int] = field(default_factory=list)
    # Versions whose parity block is complete here (parity groups; Replication.parity_versions).
    parity: List[int] = field(default_factory=list)

    def encode(self) -> bytes:
        """A JSON array, fields in declaration order, maps as [key, value] pairs: the plan
        writer decodes every member's report of a recovery (16,384 at 16,384 ranks), and
        an array of numbers parses in about half the time of an object with named fields."""
        layout = self.layout
        return json.dumps([self.rank, self.worker, self.local, list(self.replicas.items()), self.address,
                           self.needs_state, self.pid, list(self.shared_regions.items()), self.checkpoint,
                           None if layout is None else [layout.k, layout.share_count, layout.data_parallel,
                                                        layout.replica_mesh, layout.replica_dim, layout.parity_group],
                           self.stopped, self.adopted_share, self.parity]).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "MemberReport":
        return cls.from_list(json.loads(raw))

    @classmethod
    def from_list(cls, data: list) -> "MemberReport":
        """From a decoded ``encode()`` (no copies, no per-field checks)."""
        (rank, worker, local, replicas, address, needs_state, pid, regions, checkpoint, layout, stopped, adopted,
         parity) = data
        report = cls.__new__(cls)
        report.__dict__.update(
            rank=rank, worker=worker, local=local, replicas=dict(replicas), address=tuple(address),
            needs_state=needs_state, pid=pid, shared_regions=dict(regions),
            checkpoint=tuple(checkpoint) if checkpoint else None,
            layout=_layout(layout[0], layout[1], layout[2], tuple(layout[3]), layout[4], layout[5]) if layout else None,
            stopped=stopped, adopted_share=adopted, parity=parity)
        return report


@dataclass(frozen=True)
class StateLayout:
    """How the job's state is placed, as the training script configured it
    (``Job(k=..., data_parallel_shares=...)``, ``track(data_parallel=...)``).
    Every member reports it; the plan writer plans with it and refuses members
    that disagree."""

    k: int = 1
    share_count: int = 1
    data_parallel: bool = False
    # The replica sets of the data-parallel state (the ranks whose copies are equal): the
    # groups along dimension ``replica_dim`` of a mesh of shape ``replica_mesh`` (HSDP's
    # "replicate" dimension), or every rank when ``replica_mesh`` is empty (DDP).
    replica_mesh: Tuple[int, ...] = ()
    replica_dim: int = -1
    parity_group: int = 0  # g of ``Job(parity_group=g)``; 0: buddies (k)


@functools.lru_cache(maxsize=64)
def _layout(k: int, share_count: int, data_parallel: bool, replica_mesh: Tuple[int, ...],
            replica_dim: int, parity_group: int) -> StateLayout:
    return StateLayout(k, share_count, data_parallel, replica_mesh, replica_dim, parity_group)  # one per layout


@dataclass
class NodeReport:
    """The reports of one node's members in one epoch: what its agent publishes,
    the one report per node the plan writer gathers."""

    node: int
    members: List[MemberReport]

    def encode(self) -> bytes:
        return NodeReport.join(self.node, [m.encode() for m in self.members])

    @staticmethod
    def join(node: int, encoded: List[bytes]) -> bytes:
        """A NodeReport from its members' encoded reports as they came (no decoding)."""
        return b'{"node": %d, "members": [' % node + b", ".join(encoded) + b"]}"

    @classmethod
    def decode(cls, raw: bytes) -> "NodeReport":
        data = json.loads(raw)
        return cls(data["node"], [MemberReport.from_list(m) for m in data["members"]])


class RestoreSource(enum.Enum):
    """Where a member's state at the recovery point comes from."""

    LOCAL = "local"            # its own snapshot (a survivor), plus the data-parallel shares it lacks
    PEERS = "peers"            # its holders and the share holders (a replacement)
    CHECKPOINT = "checkpoint"  # the newest disk checkpoint: some rank's state has no copy left
    LOST = "lost"              # no copy and no checkpoint: the job stops


@dataclass
class SharePull:
    """One data-parallel share a member pulls: from which members, and which of
    them are on its node (source -> (pid, address of the version's region)), to
    be read straight from their memory."""

    share: int
    sources: List[int]
    same_node: Dict[int, Tuple[int, int]] = field(default_factory=dict)


@dataclass
class RestorePlan:
    """What one member does to be at ``version``: see ``planning.plan_restore``."""

    source: RestoreSource
    version: Optional[int] = None
    own_sources: List[int] = field(default_factory=list)  # PEERS: who holds this rank's own state
    shares: Dict[int, SharePull] = field(default_factory=dict)  # share -> its pull
    checkpoint: Optional[str] = None  # CHECKPOINT: the directory to load
    message: str = ""                 # CHECKPOINT, LOST: which state was lost, in words
    parity: bool = False              # PEERS: own_sources is this rank's parity group, in group order
    rebuild: List[int] = field(default_factory=list)  # LOCAL: lost members whose piece this holder rebuilds

    def to_dict(self) -> dict:
        return {"source": self.source.value, "version": self.version, "own_sources": self.own_sources,
                "shares": {s: {"share": p.share, "sources": p.sources, "same_node": p.same_node}
                           for s, p in self.shares.items()},
                "checkpoint": self.checkpoint, "message": self.message, "parity": self.parity,
                "rebuild": self.rebuild}

    @classmethod
    def from_dict(cls, data: dict) -> "RestorePlan":
        data = dict(data)
        data["source"] = RestoreSource(data["source"])
        data["shares"] = {int(s): SharePull(p["share"], list(p["sources"]),
                                            {int(r): tuple(v) for r, v in p["same_node"].items()})
                          for s, p in data["shares"].items()}
        return cls(**data)


@dataclass
class MemberInstructions:
    """What one member is told when it joins an epoch: where the peers it talks to
    listen (its holders, and the sources it pulls from), and, after a failure,
    its ``RestorePlan``."""

    rank: int
    addresses: Dict[int, Address]
    restore: Optional[RestorePlan] = None  # None in epoch 0 (nothing to restore)


@dataclass
class NodeInstructions:
    """What the plan writer tells one node in one epoch (``planning.plan_nodes``);
    its agent turns it into each member's ``MemberInstructions``
    (``planning.expand``) with its own members' reports. Its size depends on the
    node, not on the job."""

    epoch: int
    node: int
    addresses: Dict[int, Address]                # every peer the node's members talk to
    outcome: Optional[str] = None                # None (epoch 0) | restore | checkpoint | lost
    version: Optional[int] = None                # restore: the recovery point; checkpoint: its step
    message: str = ""                            # checkpoint, lost: which state was lost, in words
    checkpoint: Optional[str] = None             # checkpoint: the directory to load
    share_sources: Dict[int, List[int]] = field(default_factory=dict)  # share -> where the node pulls it from
    own_sources: Dict[int, List[int]] = field(default_factory=dict)    # member needing state -> its holders
    share_of: Dict[int, int] = field(default_factory=dict)             # member -> the share it snapshots
    members: List[int] = field(default_factory=list)                   # the node's members in this epoch
    share_count: int = 1                                               # shares per replica set (share % count: the store)
    parity: bool = False                                               # own_sources are parity groups
    rebuild: Dict[int, List[int]] = field(default_factory=dict)        # member -> lost ranks whose piece it rebuilds

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()  # flat: faster than asdict, the same fields

    @classmethod
    def decode(cls, raw: bytes) -> "NodeInstructions":
        data = json.loads(raw)
        data["addresses"] = {int(p): tuple(a) for p, a in data["addresses"].items()}
        for name in ("share_sources", "own_sources", "share_of", "rebuild"):
            data[name] = {int(k): v for k, v in data[name].items()}
        return cls(**data)

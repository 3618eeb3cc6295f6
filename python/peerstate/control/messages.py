"""What the control plane's members tell each other through the store, and
what a member is told to do: each message encodes to JSON bytes and decodes
back to the same typed object."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

Address = Tuple[str, int]


@dataclass
class RecoveryPlan:
    """Who is which rank in one epoch, and why the epoch began."""

    epoch: int
    members: Dict[int, str]                  # rank -> worker id
    replaced: Dict[int, str] = field(default_factory=dict)  # ranks that changed worker this epoch
    failed: List[int] = field(default_factory=list)
    reason: str = ""
    detected_at: float = 0.0
    planned_at: float = 0.0

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "RecoveryPlan":
        data = json.loads(raw)
        data["members"] = {int(r): w for r, w in data["members"].items()}
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

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "MemberReport":
        data = json.loads(raw)
        data["replicas"] = {int(s): list(v) for s, v in data["replicas"].items()}
        data["shared_regions"] = {int(v): a for v, a in data.get("shared_regions", {}).items()}
        data["address"] = tuple(data["address"])
        return cls(**data)


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

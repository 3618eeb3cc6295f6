"""The recovery coordinator: membership, epochs, the spare pool and recovery plans,
kept in the job's KeyValueStore.

There is no coordinator process. Whoever sees a failure (the node agent that
reaped a worker, or an agent that saw another node's lease expire) writes the
next epoch's plan; ``compare_set`` on the epoch's owner key makes exactly one
writer win, and a loser whose failure the winning plan does not cover tries
the epoch after. Workers learn of an epoch by waiting on its plan key.

A writer can die part way (its node lost during a recovery). Before its plan
is written: a loser waiting for that plan takes the epoch over (compare_set
of the owner key from the lost writer to itself) once the writer's node is
declared dead, and writes the plan itself; a spare the lost writer had
claimed stays out of the pool. After its plan but before the assign keys: the
plan is the truth, and the agent of a named spare writes its key (see
``assignments``).

Keys (all under the store given)::

    config                      the job's shape, set by the first agent
    node/{i}/lease              counter an agent bumps while it lives
    node/{i}/dead               set once node i is declared lost
    spares                      "id,id,..." every spare that ever registered
    spare/{id}                  ready | gone | assigned:{epoch}:{rank}
    spares/wanted               counter a planner bumps when it waits for a spare
    assign/{id}                 the assignment a waiting spare blocks on
    epoch/{e}/owner, /plan      the plan writer of epoch e, and its RecoveryPlan
    epoch/{e}/report/{rank}     what a member holds (see recovery_point)
    job/failed, job/finished    why the job stopped; ranks that finished

A worker is named ``n{node}.{k}``: its node is part of its name, so a plan
can leave out the spares of a dead node without asking anyone.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from peerstate.errors import JobFailedError
from peerstate.kvstore import KeyValueStore
from peerstate.placement import BuddyPlacement, DataParallelShares


def node_of_worker(worker: str) -> int:
    return int(worker[1:].split(".")[0])


def node_of_agent(agent: str) -> Optional[int]:
    """The node of an agent named ``agent{node}`` (None for any other writer name)."""
    suffix = agent[len("agent"):]
    return int(suffix) if agent.startswith("agent") and suffix.isdigit() else None


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
    address: Tuple[str, int]         # its replication server
    needs_state: bool = False        # new in this epoch, or joined earlier and not restored yet
    shared_address: Optional[Tuple[str, int]] = None  # its server of its data-parallel share
    pid: int = 0
    shared_regions: Dict[int, int] = field(default_factory=dict)  # version -> its address in that share's store

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "MemberReport":
        data = json.loads(raw)
        data["replicas"] = {int(s): list(v) for s, v in data["replicas"].items()}
        data["shared_regions"] = {int(v): a for v, a in data.get("shared_regions", {}).items()}
        data["address"] = tuple(data["address"])
        if data.get("shared_address"):
            data["shared_address"] = tuple(data["shared_address"])
        return cls(**data)


def recovery_point(reports: Mapping[int, MemberReport], placement: BuddyPlacement,
                   shares: Optional[DataParallelShares] = None) -> Tuple[Optional[int], Dict[int, str]]:
    """The newest version every rank can resume from, and why a rank cannot.

    A member that kept its state resumes from its own SnapshotStore; one that
    needs state (a replacement) from a holder's replica or a replica-group
    peer's own snapshot. With ``shares`` (how the data-parallel state, the same
    on every rank, is split among the ranks' second stores), every member also
    needs each share at that version from a member that kept its state.
    Returns (version, {}), or (None, {rank: reason}) when some rank has no
    copy left (rank -1: copies exist but of different steps).
    """
    candidates: Optional[Set[int]] = None
    lost: Dict[int, str] = {}
    for rank in sorted(reports):
        if reports[rank].needs_state:
            available: Set[int] = set()
            for source in placement.sources(rank):
                held = reports[source]
                if source in placement.replica_group(rank):
                    available.update(held.local)
                else:
                    available.update(held.replicas.get(rank, []))
            if not available:
                gone = [s for s in placement.sources(rank) if reports[s].needs_state]
                lost[rank] = (f"shard of rank {rank} has no surviving copy (its holders {gone} were lost too)"
                              if gone else f"rank {rank} has no committed copy on any holder yet")
                continue
        else:
            available = set(reports[rank].local)
        candidates = available if candidates is None else candidates & available
    for share in range(shares.count if shares is not None else 0):
        holders = shares.holders(share)
        kept = [s for s in holders if not reports[s].needs_state]
        if not kept:
            lost[min(holders)] = (f"data-parallel share {share} has no surviving copy (its holders {holders} "
                                  "were all lost)")
        elif candidates is not None:
            candidates &= {v for s in kept for v in reports[s].local}
    if lost:
        return None, lost
    if not candidates:
        return None, {-1: "no version is held for every rank at once (the copies are of different steps)"}
    return max(candidates), {}


def sources_of(rank: int, version: int, reports: Mapping[int, MemberReport],
               placement: BuddyPlacement) -> List[int]:
    """The members that hold ``rank``'s ``version`` (where a replacement pulls from)."""
    group = placement.replica_group(rank)
    return [s for s in placement.sources(rank)
            if (s in group and version in reports[s].local) or version in reports[s].replicas.get(rank, [])]


def share_sources(share: int, version: int, reports: Mapping[int, MemberReport],
                  shares: DataParallelShares) -> List[int]:
    """The members that kept their state and hold data-parallel ``share`` at ``version``."""
    return [s for s in shares.holders(share) if not reports[s].needs_state and version in reports[s].local]


def _assignment(epoch: int, rank: int) -> bytes:
    """The value of a spare's ``assign/{worker}`` key."""
    return json.dumps({"epoch": epoch, "rank": rank}).encode()


def same_node_regions(worker: str, version: int, sources: List[int],
                      reports: Mapping[int, MemberReport]) -> Dict[int, Tuple[int, int]]:
    """source -> (pid, address of ``version``'s data-parallel region) for the sources
    on ``worker``'s node: a member pulling a data-parallel share reads those straight
    from their memory."""
    node = node_of_worker(worker)
    return {s: (reports[s].pid, reports[s].shared_regions[version]) for s in sources
            if node_of_worker(reports[s].worker) == node and reports[s].pid
            and reports[s].shared_regions.get(version)}


class Coordinator:
    """The coordinator's operations over the job's store (used by the agents;
    workers only read plans)."""

    def __init__(self, kv: KeyValueStore) -> None:
        self.kv = kv
        self._known_epoch = 0

    # -- epochs ----------------------------------------------------------------------
    def plan(self, epoch: int) -> Optional[RecoveryPlan]:
        raw = self.kv.get(f"epoch/{epoch}/plan")
        return RecoveryPlan.decode(raw) if raw else None

    def latest_plan(self) -> RecoveryPlan:
        """The newest plan (epoch 0 must exist)."""
        plan = self.plan(self._known_epoch)
        if plan is None:
            raise JobFailedError("the job has no epoch-0 plan: the agents have not started it")
        while True:
            newer = self.plan(plan.epoch + 1)
            if newer is None:
                self._known_epoch = plan.epoch
                return plan
            plan = newer

    def start(self, members: Dict[int, str]) -> RecoveryPlan:
        """Write the epoch-0 plan (idempotent: every agent may call it)."""
        plan = RecoveryPlan(0, dict(members), reason="start", planned_at=time.time())
        self.kv.compare_set("epoch/0/plan", b"", plan.encode())
        return self.plan(0)

    # -- spares ----------------------------------------------------------------------
    def register_spare(self, worker: str) -> None:
        self.kv.set(f"spare/{worker}", b"ready")
        self.kv.append("spares", f"{worker},".encode())

    def spare_gone(self, worker: str) -> Optional[Tuple[int, int]]:
        """Take a dead spare out of the pool. Returns (epoch, rank) if it had already
        been assigned (then its death is that rank's failure)."""
        now = self.kv.compare_set(f"spare/{worker}", b"ready", b"gone").decode()
        if now.startswith("assigned:"):
            _, epoch, rank = now.split(":")
            return int(epoch), int(rank)
        return None

    def ready_spares(self) -> List[str]:
        raw = (self.kv.get("spares") or b"").decode()
        ids = [w for w in raw.split(",") if w]
        dead_nodes = self.dead_nodes()
        ids = [w for w in ids if node_of_worker(w) not in dead_nodes]
        states = self.kv.get_many([f"spare/{w}" for w in ids])
        return [w for w, s in zip(ids, states) if s == b"ready"]

    # -- nodes -----------------------------------------------------------------------
    def mark_node_dead(self, node: int) -> None:
        self.kv.set(f"node/{node}/dead", b"1")

    def dead_nodes(self) -> Set[int]:
        nodes = int(json.loads(self.kv.get("config") or b"{}").get("nnodes", 0))
        flags = self.kv.get_many([f"node/{n}/dead" for n in range(nodes)])
        return {n for n, flag in zip(range(nodes), flags) if flag}

    # -- failures --------------------------------------------------------------------
    def report_failure(self, workers: Iterable[str], reason: str, *, detected_at: float,
                       me: str, spare_timeout: float = 30.0, writer_grace: float = 30.0) -> Optional[RecoveryPlan]:
        """Replace the ranks the dead ``workers`` hold. Returns the plan that does so
        (this caller's or a concurrent one's), or None if none of them is a member.

        Blocks while another writer holds the epoch, up to ``spare_timeout +
        writer_grace`` (it may be waiting for a spare), and takes the epoch over if
        that writer's node is declared dead first. Raises JobFailedError when no
        spare becomes ready within ``spare_timeout``, or when the other writer
        neither writes its plan nor is declared dead in time.
        """
        dead = set(workers)
        while True:
            current = self.latest_plan()
            failed = sorted(r for r, w in current.members.items() if w in dead)
            if not failed:
                return None  # already replaced by an earlier plan
            epoch = current.epoch + 1
            owner = self.kv.compare_set(f"epoch/{epoch}/owner", b"", me.encode())
            if owner != me.encode() and not self._wait_or_take_over(epoch, me, spare_timeout + writer_grace):
                continue  # re-read: the winner's plan may or may not cover our failure
            replaced = self._assign_spares(epoch, failed, current, spare_timeout)
            members = dict(current.members)
            members.update(replaced)
            plan = RecoveryPlan(epoch, members, replaced, failed, reason, detected_at, time.time())
            self.kv.set(f"epoch/{epoch}/plan", plan.encode())
            for rank, worker in replaced.items():
                self.kv.set(f"assign/{worker}", _assignment(epoch, rank))
            return plan

    def _wait_or_take_over(self, epoch: int, me: str, timeout: float) -> bool:
        """Wait for another writer's plan of ``epoch``: False once it is written, True
        once this caller took the epoch over from a writer whose node was declared dead."""
        key, plan_key = f"epoch/{epoch}/owner", f"epoch/{epoch}/plan"
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.kv.wait([plan_key], timeout=0.25)
                return False
            except TimeoutError:
                pass
            owner = self.kv.get(key) or b""
            if node_of_agent(owner.decode()) in self.dead_nodes():
                if self.kv.compare_set(key, owner, me.encode()) == me.encode():
                    return True
                continue  # another survivor took it over first: wait for its plan
            if time.monotonic() > deadline:
                raise JobFailedError(
                    f"{owner.decode()} began epoch {epoch}'s recovery plan but neither wrote it nor was declared "
                    f"lost within {timeout:.0f}s; the job cannot recover. Check that agent's node and its log.")

    def assignments(self, spares: Sequence[str]) -> Dict[str, int]:
        """The ranks the latest plan gives to any of these waiting ``spares``. Also
        writes each one's assign key if the plan's writer died before it could."""
        plan = self.latest_plan()
        waiting = set(spares)
        ranks = {w: r for r, w in plan.members.items() if w in waiting}
        for worker, rank in ranks.items():
            self.kv.compare_set(f"assign/{worker}", b"", _assignment(plan.epoch, rank))
        return ranks

    def _assign_spares(self, epoch: int, failed: Sequence[int], current: RecoveryPlan,
                       timeout: float) -> Dict[int, str]:
        """Claim one ready spare per failed rank, preferring the failed worker's own node
        (its buddies were chosen to be elsewhere). Waits for the pool to refill."""
        deadline = time.monotonic() + timeout
        replaced: Dict[int, str] = {}
        asked = False
        for rank in failed:
            home = node_of_worker(current.members[rank])
            while rank not in replaced:
                spares = sorted(self.ready_spares(), key=lambda w: (node_of_worker(w) != home, w))
                for worker in spares:
                    claim = f"assigned:{epoch}:{rank}".encode()
                    if self.kv.compare_set(f"spare/{worker}", b"ready", claim) == claim:
                        replaced[rank] = worker
                        break
                else:
                    if not asked:  # agents hold back refills during a recovery unless asked
                        self.kv.add("spares/wanted", 1)
                        asked = True
                    if time.monotonic() > deadline:
                        for r, worker in replaced.items():  # give back what was claimed
                            self.kv.compare_set(f"spare/{worker}", f"assigned:{epoch}:{r}".encode(), b"ready")
                        raise JobFailedError(
                            f"no hot spare became ready within {timeout:.0f}s to replace rank {rank} "
                            "(every spare started so far is in use or lost). Start the job with more --spares.")
                    time.sleep(0.05)
        return replaced

    def fail_job(self, message: str) -> str:
        """Record why the job stops (the first reason wins); returns the recorded one."""
        return self.kv.compare_set("job/failed", b"", message.encode()).decode()

    def failure(self) -> Optional[str]:
        raw = self.kv.get("job/failed")
        return raw.decode() if raw else None

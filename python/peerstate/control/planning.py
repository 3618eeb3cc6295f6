"""The control plane's decisions, as pure functions of what the members report:
the recovery point, where each rank's state and each data-parallel share is
pulled from, and each member's restore plan. Nothing here touches a store or
a process; tests call them with hand-made reports.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from peerstate.control.messages import MemberReport, RestorePlan, RestoreSource, SharePull
from peerstate.replication.placement import BuddyPlacement, DataParallelShares


def node_of_worker(worker: str) -> int:
    return int(worker[1:].split(".")[0])


def node_of_agent(agent: str) -> Optional[int]:
    """The node of an agent named ``agent{node}`` (None for any other writer name)."""
    suffix = agent[len("agent"):]
    return int(suffix) if agent.startswith("agent") and suffix.isdigit() else None


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


def same_node_regions(worker: str, version: int, sources: List[int],
                      reports: Mapping[int, MemberReport]) -> Dict[int, Tuple[int, int]]:
    """source -> (pid, address of ``version``'s data-parallel region) for the sources
    on ``worker``'s node: a member pulling a data-parallel share reads those straight
    from their memory."""
    node = node_of_worker(worker)
    return {s: (reports[s].pid, reports[s].shared_regions[version]) for s in sources
            if node_of_worker(reports[s].worker) == node and reports[s].pid
            and reports[s].shared_regions.get(version)}


def describe_loss(lost: Mapping[int, str], failed: Sequence[int]) -> str:
    """One sentence naming the lost ranks and why each lost state has no copy."""
    ranks = sorted(r for r in lost if r >= 0) or list(failed)
    return f"rank{'s' if len(ranks) > 1 else ''} {' and '.join(map(str, ranks))} lost; " + "; ".join(lost.values())


def plan_restore(rank: int, worker: str, needs_state: bool, reports: Mapping[int, MemberReport],
                 placement: BuddyPlacement, shares: Optional[DataParallelShares], failed: Sequence[int],
                 checkpoint: Optional[Tuple[int, str]] = None) -> RestorePlan:
    """What ``rank`` (run by ``worker``) does to be at the recovery point.

    ``needs_state``: it holds nothing (a replacement), so it pulls its own state
    from its holders; otherwise it rolls back from its own snapshot. With
    ``shares`` (data-parallel state in shares) it also pulls every share it does
    not snapshot itself (every share, when it needs state). ``checkpoint``: the
    newest disk checkpoint (step, path), the fallback when some state has no
    surviving copy; without one such a loss is LOST.
    """
    version, lost = recovery_point(reports, placement, shares)
    if version is None:
        message = describe_loss(lost, failed)
        if checkpoint is None:
            return RestorePlan(RestoreSource.LOST, message=message)
        step, path = checkpoint
        return RestorePlan(RestoreSource.CHECKPOINT, version=step, checkpoint=path, message=message)
    pulls: Dict[int, SharePull] = {}
    own_share = shares.share_of(rank) if shares is not None else None
    for share in range(shares.count if shares is not None else 0):
        if share == own_share and not needs_state:
            continue
        sources = share_sources(share, version, reports, shares)
        pulls[share] = SharePull(share, sources, same_node_regions(worker, version, sources, reports))
    if not needs_state:
        return RestorePlan(RestoreSource.LOCAL, version=version, shares=pulls)
    return RestorePlan(RestoreSource.PEERS, version=version, own_sources=sources_of(rank, version, reports, placement),
                       shares=pulls)

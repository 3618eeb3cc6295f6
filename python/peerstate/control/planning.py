"""The control plane's decisions, as pure functions of what the members report:
the recovery point, where each rank's state and each data-parallel share is
pulled from, and each member's restore plan. Nothing here touches a store or
a process; tests call them with hand-made reports.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from peerstate.control.messages import (MemberInstructions, MemberReport, NodeInstructions, RestorePlan, RestoreSource,
                                        SharePull)
from peerstate.replication.parity import ParityPlacement
from peerstate.replication.placement import BuddyPlacement, DataParallelShares

Placement = Union[BuddyPlacement, ParityPlacement]  # buddies, or parity groups (Job(parity_group=g))


@functools.lru_cache(maxsize=1 << 16)
def node_of_worker(worker: str) -> int:
    return int(worker[1:].split(".")[0])


def node_of_agent(agent: str) -> Optional[int]:
    """The node of an agent named ``agent{node}``, or of a claim made for it,
    ``agent{node}/{worker}`` (None for any other writer name)."""
    suffix = agent.split("/", 1)[0][len("agent"):]
    return int(suffix) if agent.startswith("agent") and suffix.isdigit() else None


def recovery_point(reports: Mapping[int, MemberReport], placement: Placement,
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
    parity = getattr(placement, "parity", False)
    for rank in sorted(reports):
        if reports[rank].needs_state and parity:
            available, why = _parity_versions(rank, reports, placement)
            if why:
                lost[rank] = why
                continue
        elif reports[rank].needs_state:
            available = set()
            for source in placement.sources(rank):
                held = reports[source]
                if source in placement.replica_group(rank):
                    available.update(held.local)
                else:
                    available.update(held.replicas.get(rank, []))
            available.update(reports[rank].stopped)  # read from its hung predecessor's memory
            if not available:
                gone = [s for s in placement.sources(rank) if reports[s].needs_state]
                lost[rank] = (f"shard of rank {rank} has no surviving copy (its holders {gone} were lost too)"
                              if gone else f"rank {rank} has no committed copy on any holder yet")
                continue
        else:
            available = set(reports[rank].local)
        candidates = available if candidates is None else candidates & available
    for share in range(shares.total if shares is not None else 0):
        holders = shares.holders(share)
        kept = [s for s in holders if not reports[s].needs_state or reports[s].adopted_share]
        if not kept:
            lost[min(holders)] = (f"data-parallel share {share} has no surviving copy (its holders {holders} "
                                  "were all lost)")
        elif candidates is not None:
            candidates &= {v for s in kept for v in share_versions(reports[s])}
    if lost:
        return None, lost
    if not candidates:
        return None, {-1: "no version is held for every rank at once (the copies are of different steps)"}
    return max(candidates), {}


def _parity_versions(rank: int, reports: Mapping[int, MemberReport],
                     placement: ParityPlacement) -> Tuple[Set[int], str]:
    """The versions ``rank``'s state can be rebuilt at from its parity group: those whose
    block every other member holds complete, and which every other member still holds of
    its own state (each holder rebuilds its piece from the other survivors' snapshots).
    With another member lost too, none, and why (naming the group)."""
    others = placement.holders(rank)
    dead = [m for m in others if reports[m].needs_state]
    if dead:
        lost = sorted([rank, *dead])
        return set(), (f"parity group {placement.group_of(rank)} lost ranks {', '.join(map(str, lost))}: a group "
                       "rebuilds one lost member, so their state has no surviving copy")
    available: Optional[Set[int]] = None
    for member in others:
        held = set(reports[member].parity) & set(reports[member].local)
        available = held if available is None else available & held
    if not available:
        return set(), (f"rank {rank} has no version its parity group {placement.group_of(rank)} covers whole yet "
                       "(every member's block and own snapshot of one version)")
    return available, ""


def sources_of(rank: int, version: int, reports: Mapping[int, MemberReport],
               placement: Placement) -> List[int]:
    """The members that hold ``rank``'s ``version`` (where a replacement pulls from):
    ``rank`` itself first when its hung predecessor holds it (read from memory). In a
    parity group, its whole group in group order (the replacement pulls one piece from
    each other member, which rebuilt it)."""
    if getattr(placement, "parity", False):
        return placement.group_of(rank)
    group = placement.replica_group(rank)
    return [rank] * (version in reports[rank].stopped) + [
        s for s in placement.sources(rank)
        if (s in group and version in reports[s].local) or version in reports[s].replicas.get(rank, [])]


def share_versions(report: MemberReport) -> List[int]:
    """The versions of its data-parallel share a member holds: a survivor's own snapshots,
    or those a replacement adopted from its stopped predecessor."""
    return report.adopted_share if report.needs_state else report.local


def share_sources(share: int, version: int, reports: Mapping[int, MemberReport],
                  shares: DataParallelShares) -> List[int]:
    """The members that hold data-parallel ``share`` at ``version``."""
    return [s for s in shares.holders(share) if version in share_versions(reports[s])]


def same_node_regions(worker: str, version: int, sources: List[int],
                      reports: Mapping[int, MemberReport]) -> Dict[int, Tuple[int, int]]:
    """source -> (pid, address of ``version``'s data-parallel region) for the sources
    on ``worker``'s node (``reports`` may hold that node's members only): a member
    pulling a data-parallel share reads those straight from their memory."""
    node = node_of_worker(worker)
    return {s: (reports[s].pid, reports[s].shared_regions[version]) for s in sources
            if s in reports and node_of_worker(reports[s].worker) == node and reports[s].pid
            and reports[s].shared_regions.get(version)}


def lost_without_checkpoint(message: str) -> str:
    """Why the job stops when ``message``'s state has no copy and there is no checkpoint."""
    return f"{message}. No disk checkpoint is configured (--checkpoint-dir), so the job stops."


def describe_loss(lost: Mapping[int, str], failed: Sequence[int]) -> str:
    """One sentence naming the lost ranks and why each lost state has no copy."""
    ranks = sorted(r for r in lost if r >= 0) or list(failed)
    reasons = dict.fromkeys(lost.values())  # once each: the members of one parity group share theirs
    return f"rank{'s' if len(ranks) > 1 else ''} {' and '.join(map(str, ranks))} lost; " + "; ".join(reasons)


SHARE_SOURCES = 4  # members a share is pulled from at most, whatever the number of holders


class ShareHolders:
    """The members a share can be pulled from at the recovery point, indexed by node
    so that choosing a node's sources costs O(SHARE_SOURCES), not O(nodes)."""

    def __init__(self, sources: List[int], node_of: Mapping[int, int]) -> None:
        self.sources = sources
        self._nodes = [node_of[s] for s in sources]
        self._by_node: Dict[int, List[int]] = {}
        for source, node in zip(sources, self._nodes):
            self._by_node.setdefault(node, []).append(source)

    def pick(self, node: int) -> List[int]:
        """Up to ``SHARE_SOURCES`` sources for the members of ``node`` (all of them, in
        order, when there are no more): the ones on the node first (read from memory),
        then others chosen by node, so that the nodes' pulls spread over all holders
        (a share of a large job has one holder per node)."""
        if len(self.sources) <= SHARE_SOURCES:
            return self.sources
        picked = list(self._by_node.get(node, [])[:SHARE_SOURCES])
        index = node % len(self.sources)
        for _ in range(len(self.sources)):
            if len(picked) == SHARE_SOURCES:
                break
            if self._nodes[index] != node:
                picked.append(self.sources[index])
            index = (index + 1) % len(self.sources)
        return picked


def plan_nodes(epoch: int, reports: Mapping[int, MemberReport], placement: Placement,
               shares: Optional[DataParallelShares], failed: Sequence[int] = (),
               checkpoint: Optional[Tuple[int, str]] = None) -> Dict[int, NodeInstructions]:
    """Every node's instructions for ``epoch``: the plan writer's part, O(N) once.

    In epoch 0 they only name the peers (every rank's holders). After a failure
    they carry the recovery point, for each share (``shares``: data-parallel
    state in shares) the members of the node pull it from, and for each
    member that needs state (a replacement) its holders at that point. When
    some state has no surviving copy, every node is told to load the newest
    disk ``checkpoint`` (step, path), or, without one, that the state is lost.
    ``expand`` turns a node's instructions into each member's."""
    node_of = {r: node_of_worker(report.worker) for r, report in reports.items()}
    parity = getattr(placement, "parity", False)
    by_node: Dict[int, List[int]] = {}
    for rank in sorted(reports):
        by_node.setdefault(node_of[rank], []).append(rank)
    outcome, version, message, path = None, None, "", None
    holders_at: Dict[int, ShareHolders] = {}
    if epoch > 0:
        version, lost = recovery_point(reports, placement, shares)
        if version is None:
            message = describe_loss(lost, failed)
            outcome = "lost" if checkpoint is None else "checkpoint"
            version, path = checkpoint if checkpoint is not None else (None, None)
        else:
            outcome = "restore"
            holders_at = {share: ShareHolders(share_sources(share, version, reports, shares), node_of)
                          for share in range(shares.total if shares is not None else 0)}
    orders: Dict[int, NodeInstructions] = {}
    for node, ranks in by_node.items():
        # The shares of the node's members' replica sets (every share under DDP).
        pulls = {share: holders_at[share].pick(node)
                 for share in sorted({s for r in ranks for s in shares.set_shares(r)})} if holders_at else {}
        own = {r: sources_of(r, version, reports, placement) for r in ranks
               if outcome == "restore" and reports[r].needs_state}
        rebuild: Dict[int, List[int]] = {}  # in parity groups: a survivor rebuilds its piece of each lost member
        for r in ranks if outcome == "restore" and parity else ():
            lost_members = [m for m in placement.holders(r) if reports[m].needs_state]
            if lost_members and not reports[r].needs_state:
                rebuild[r] = lost_members
        peers = {p for r in ranks for p in placement.holders(r)}
        peers.update(p for sources in own.values() for p in sources)
        peers.update(p for sources in pulls.values() for p in sources)
        orders[node] = NodeInstructions(
            epoch, node, {p: reports[p].address for p in sorted(peers)}, outcome, version, message, path, pulls, own,
            {r: shares.share_of(r) for r in ranks} if holders_at else {}, list(ranks),
            shares.count if shares is not None else 1, parity, rebuild)
    return orders


def expand(orders: NodeInstructions, reports: Mapping[int, MemberReport],
           ranks: Optional[Sequence[int]] = None) -> Dict[int, MemberInstructions]:
    """The instructions of the node's members ``ranks`` (default: all of them) from
    the node's: each member's own part, computed in the member, from the reports of
    its node's members (which give the same-node regions)."""
    members: Dict[int, MemberInstructions] = {}
    for rank in (reports if ranks is None else ranks):
        report = reports[rank]
        restore: Optional[RestorePlan] = None
        if orders.outcome == "lost":
            restore = RestorePlan(RestoreSource.LOST, message=orders.message)
        elif orders.outcome == "checkpoint":
            restore = RestorePlan(RestoreSource.CHECKPOINT, version=orders.version, checkpoint=orders.checkpoint,
                                  message=orders.message)
        elif orders.outcome == "restore":
            # The shares of its replica set it does not hold at that version (all of them for
            # a replacement, but the one it adopted), by their index in the set: the store
            # that receives each.
            count, own = orders.share_count, orders.share_of.get(rank)
            has_own = orders.version in share_versions(report)
            pulls = {share % count: SharePull(share % count, sources,
                                              same_node_regions(report.worker, orders.version, sources, reports))
                     for share, sources in orders.share_sources.items()
                     if share // count == own // count and (share != own or not has_own)}
            restore = (RestorePlan(RestoreSource.PEERS, version=orders.version, own_sources=orders.own_sources[rank],
                                   shares=pulls, parity=orders.parity) if report.needs_state else
                       RestorePlan(RestoreSource.LOCAL, version=orders.version, shares=pulls,
                                   rebuild=orders.rebuild.get(rank, [])))
        members[rank] = MemberInstructions(rank, orders.addresses, restore)
    return members


def plan_restores(reports: Mapping[int, MemberReport], placement: Placement,
                  shares: Optional[DataParallelShares], failed: Sequence[int],
                  checkpoint: Optional[Tuple[int, str]] = None) -> Dict[int, RestorePlan]:
    """Every member's restore plan after a failure: ``plan_nodes`` then ``expand``,
    as the plan writer and the node agents compute them together."""
    plans: Dict[int, RestorePlan] = {}
    for node, orders in plan_nodes(1, reports, placement, shares, failed, checkpoint).items():
        mine = {r: reports[r] for r in reports if node_of_worker(reports[r].worker) == node}
        plans.update({r: m.restore for r, m in expand(orders, mine).items()})
    return plans


def plan_restore(rank: int, reports: Mapping[int, MemberReport], placement: Placement,
                 shares: Optional[DataParallelShares], failed: Sequence[int],
                 checkpoint: Optional[Tuple[int, str]] = None) -> RestorePlan:
    """One member's part of ``plan_restores``."""
    return plan_restores(reports, placement, shares, failed, checkpoint)[rank]

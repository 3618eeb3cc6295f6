"""BuddyPlacement: which ranks hold whose snapshot.

Deterministic from the world layout (each rank's node, optionally its rack,
optionally its snapshot size): every process computes the same placement with
no communication. Rank r's k buddies are the ranks with r's local index on the
next k nodes of a ring of nodes; when racks are given, the ring alternates
racks, so a buddy sits in another rack whenever the layout allows. With equal
nodes every holder serves exactly k ranks: equal bytes for equal ranks. When
ranks differ in size (``bytes_of_rank``, e.g. pipeline stages), holders are
chosen instead largest rank first, each from the least-loaded ranks of the
best failure domain available, so that every holder serves about the same
bytes.

Where failure domains cannot be separated (one node; fewer other nodes than
k), the placement says so loudly: a warning by default, an error with
``strict=True``.

Replica groups (ranks whose state is identical, e.g. data-parallel replicas)
need no buddies: each member is a source for the others, with no replication
traffic and no extra memory. ``DataParallelShares`` says how much of that
identical state each rank snapshots.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from peerstate.errors import InvalidArgumentError


class PlacementWarning(UserWarning):
    """A placement that leaves copies in the same failure domain as their source."""


def node_ring(ranks_by_node: "OrderedDict[Hashable, List[int]]",
              rack_of_rank: Optional[Sequence[Hashable]] = None) -> List[Hashable]:
    """The nodes in ring order: as listed, or, with racks, round-robin over the racks
    (a node's rack is its first rank's), so that ring neighbours sit in different racks."""
    nodes = list(ranks_by_node)
    if rack_of_rank is None:
        return nodes
    by_rack: "OrderedDict[Hashable, List[Hashable]]" = OrderedDict()
    for node in nodes:
        by_rack.setdefault(rack_of_rank[ranks_by_node[node][0]], []).append(node)
    ring: List[Hashable] = []
    columns = max(len(v) for v in by_rack.values())
    for i in range(columns):
        ring.extend(v[i] for v in by_rack.values() if i < len(v))
    return ring


def warn_unseparated(said: List[str], message: str, strict: bool) -> None:
    """Say (a PlacementWarning, also kept in ``said``) or, with ``strict``, refuse a
    placement that leaves copies in their source's failure domain."""
    if strict:
        raise InvalidArgumentError(f"cannot separate failure domains: {message}")
    said.append(message)
    warnings.warn(message, PlacementWarning, stacklevel=3)


class BuddyPlacement:
    """k-buddy placement over nodes (and racks).

    Args:
        node_of_rank: the node id of each rank (index = rank).
        k: copies of each rank's snapshot kept on other ranks.
        rack_of_rank: optional rack id of each rank.
        replica_groups: optional lists of ranks holding identical state.
        strict: raise instead of warning when failure domains cannot be separated.
        bytes_of_rank: optional snapshot size of each rank, to balance bytes per holder.
    """

    def __init__(
        self,
        node_of_rank: Sequence[Hashable],
        k: int = 1,
        rack_of_rank: Optional[Sequence[Hashable]] = None,
        replica_groups: Optional[Sequence[Sequence[int]]] = None,
        strict: bool = False,
        bytes_of_rank: Optional[Sequence[int]] = None,
    ) -> None:
        world = len(node_of_rank)
        if world == 0:
            raise InvalidArgumentError("node_of_rank is empty: give the node id of every rank")
        if k < 1 or k >= world:
            raise InvalidArgumentError(f"k must be between 1 and world size - 1 = {world - 1} (got {k})")
        if rack_of_rank is not None and len(rack_of_rank) != world:
            raise InvalidArgumentError(f"rack_of_rank has {len(rack_of_rank)} entries for {world} ranks")
        if bytes_of_rank is not None and (len(bytes_of_rank) != world or min(bytes_of_rank) < 0):
            raise InvalidArgumentError(f"bytes_of_rank needs {world} sizes >= 0 (got {list(bytes_of_rank)})")
        self.world_size = world
        self.k = k
        self.node_of_rank = list(node_of_rank)
        self.rack_of_rank = list(rack_of_rank) if rack_of_rank is not None else None
        self.warnings: List[str] = []

        self._group_of: Dict[int, List[int]] = {}
        for group in replica_groups or []:
            members = sorted(set(group))
            for r in members:
                if not 0 <= r < world:
                    raise InvalidArgumentError(f"replica group {list(group)} names rank {r} outside 0..{world - 1}")
                if r in self._group_of:
                    raise InvalidArgumentError(f"rank {r} is in two replica groups")
                if len(members) > 1:
                    self._group_of[r] = members
            if len(members) > 1 and len({self.node_of_rank[r] for r in members}) == 1:
                warn_unseparated(self.warnings,
                                 f"replica group {members} lies on one node ({self.node_of_rank[members[0]]!r}): "
                                 "losing that node loses every copy", strict)

        ranks_by_node: "OrderedDict[Hashable, List[int]]" = OrderedDict()
        for rank, node in enumerate(self.node_of_rank):
            ranks_by_node.setdefault(node, []).append(rank)
        ring = node_ring(ranks_by_node, self.rack_of_rank)
        self._ring_position = {n: i for i, n in enumerate(ring)}

        self._holders: Dict[int, List[int]] = {}
        if bytes_of_rank is None:
            for rank in range(world):
                self._holders[rank] = [] if rank in self._group_of else self._ring_holders(rank, ring, ranks_by_node)
        else:
            self._balance_bytes(list(bytes_of_rank))

        if len(ring) == 1:
            warn_unseparated(self.warnings,
                             f"all {world} ranks are on one node ({ring[0]!r}): buddies share the node, so a node "
                             "failure loses every copy; use several nodes for real protection", strict)
        elif len(ring) - 1 < k:
            warn_unseparated(self.warnings,
                             f"k={k} copies need {k} other nodes but there are only {len(ring) - 1}: some copies "
                             "share a node with their source", strict)
        if self.rack_of_rank is not None and len(set(self.rack_of_rank)) > 1:
            same_rack = [r for r, hs in self._holders.items() for h in hs if self.rack_of_rank[h] == self.rack_of_rank[r]]
            if same_rack:
                warn_unseparated(self.warnings,
                                 f"ranks {sorted(set(same_rack))} have a buddy in their own rack: the racks are too "
                                 "uneven to separate every copy", strict)

    def _ring_holders(self, rank: int, ring: List[Hashable], ranks_by_node: "OrderedDict") -> List[int]:
        """The ranks with ``rank``'s local index on the next k nodes of the ring."""
        node = self.node_of_rank[rank]
        position = self._ring_position[node]
        local = ranks_by_node[node].index(rank)
        # Without racks only the next k nodes matter: O(k) per rank, not O(nodes).
        span = len(ring) if self.rack_of_rank is not None else min(len(ring), self.k + 1)
        order = [ring[(position + step) % len(ring)] for step in range(1, span)]
        if self.rack_of_rank is not None:  # other racks first, each in ring order
            rack = self.rack_of_rank
            order = ([n for n in order if rack[ranks_by_node[n][0]] != rack[rank]] +
                     [n for n in order if rack[ranks_by_node[n][0]] == rack[rank]])
        holders: List[int] = []
        for other_node in order[: self.k]:
            other = ranks_by_node[other_node]
            holders.append(other[local % len(other)])
        if len(holders) < self.k:  # fewer other nodes than k: fill from the own node, loudly
            same = [r for r in ranks_by_node[node] if r != rank]
            start = local % max(len(same), 1)
            for r in same[start:] + same[:start]:
                if len(holders) == self.k:
                    break
                if r not in holders:
                    holders.append(r)
        return holders

    def _balance_bytes(self, sizes: List[int]) -> None:
        """Largest rank first; each copy goes to the least-loaded rank of the best
        failure domain left (another node, another rack), ties broken by rank,
        so the result is deterministic."""
        load = [0] * self.world_size
        for rank in sorted(range(self.world_size), key=lambda r: (-sizes[r], r)):
            if rank in self._group_of:
                self._holders[rank] = []
                continue
            holders: List[int] = []
            rack = self.rack_of_rank or [None] * self.world_size
            for _ in range(self.k):
                used_nodes = {self.node_of_rank[h] for h in holders} | {self.node_of_rank[rank]}
                used_racks = {rack[h] for h in holders}

                def preference(h: int):
                    # Outside the source's node, then outside its rack, then apart from
                    # the other copies' racks; then the least bytes; then the lowest rank.
                    return (self.node_of_rank[h] in used_nodes, rack[h] is not None and rack[h] == rack[rank],
                            rack[h] is not None and rack[h] in used_racks, load[h], h)

                candidates = [h for h in range(self.world_size) if h != rank and h not in holders]
                best = min(candidates, key=preference)
                holders.append(best)
                load[best] += sizes[rank]
            self._holders[rank] = holders

    def holders(self, rank: int) -> List[int]:
        """The ranks that keep a copy of ``rank``'s snapshot (empty for a replica-group member)."""
        return list(self._holders[rank])

    def served_by(self, holder: int) -> List[int]:
        """The ranks whose snapshots ``holder`` keeps."""
        return [r for r, hs in self._holders.items() if holder in hs]

    def sources(self, rank: int) -> List[int]:
        """Where ``rank``'s state can be pulled from: its replica-group peers (their own
        snapshots) or its buddies (their replicas of it)."""
        if rank in self._group_of:
            return [r for r in self._group_of[rank] if r != rank]
        return self.holders(rank)

    def replica_group(self, rank: int) -> List[int]:
        """The ranks holding the same state as ``rank`` (just ``[rank]`` outside any group)."""
        return list(self._group_of.get(rank, [rank]))

    def lost(self, dead: Sequence[int]) -> List[int]:
        """The ranks among ``dead`` whose state has no surviving copy."""
        dead_set = set(dead)
        return [r for r in sorted(dead_set) if all(s in dead_set for s in self.sources(r))]


def mesh_replica_sets(world_size: int, mesh_shape: Sequence[int], dim: int) -> List[List[int]]:
    """The groups of ranks along dimension ``dim`` of a row-major mesh of ``mesh_shape``
    over ranks 0..world_size-1 (how ``init_device_mesh`` lays ranks out): for HSDP's
    ("replicate", "shard") mesh and ``dim=0``, the ranks that hold the same shard."""
    shape = [int(size) for size in mesh_shape]
    if not 0 <= dim < len(shape) or math.prod(shape) != world_size:
        raise InvalidArgumentError(f"mesh {shape} has no dimension {dim} over {world_size} ranks")
    stride = math.prod(shape[dim + 1:])
    size = shape[dim]
    starts = [r for r in range(world_size) if (r // stride) % size == 0]
    return [[start + i * stride for i in range(size)] for start in starts]


class DataParallelShares:
    """Which share of the data-parallel state each rank snapshots.

    Data-parallel state is the same on every member of a *replica set*: every rank
    under DDP (one set, the default), or, under HSDP, the ranks that hold the same
    shard (one set per shard, the mesh's "replicate" dimension). Every member trains
    with all of its set's state, but copying all of it at every step on every member
    makes as many snapshots as members, where one per failure domain is the
    redundancy. So each set's state is cut into ``count`` shares of equal bytes
    (``split``), and the member with index i among its set's members on its node
    snapshots that set's share ``i % count``: each node keeps ``members on the node
    / count`` full copies of each set's state, and a job of N nodes N times that.
    ``count=1`` is a full copy on every member (HSDP, where a set has one member
    per node, always is). No share is replicated to buddies: its holders are each
    other's copies.

    Shares are numbered across the job (set s has shares ``s * count`` to
    ``s * count + count - 1``); ``local(share)`` is its index among its set's,
    which is what a rank's share stores and its server use.

    The price is paid at recovery: a rank that rolls back restores its own share
    from its memory and pulls its set's others, from its node's ranks while they
    live, else from another node; a replacement pulls every share of its set.

    Args:
        node_of_rank: the node id of each rank (index = rank).
        count: shares per replica set, at most the members a set has on any node it
            spans; more than one needs every set on two nodes at least (one node
            holds one copy of each share).
        replica_sets: the replica sets, a partition of the ranks (default: one set,
            every rank).
    """

    def __init__(self, node_of_rank: Sequence[Hashable], count: int,
                 replica_sets: Optional[Sequence[Sequence[int]]] = None) -> None:
        world = len(node_of_rank)
        sets = [list(range(world))] if replica_sets is None else [sorted(s) for s in replica_sets]
        if sorted(r for members in sets for r in members) != list(range(world)):
            raise InvalidArgumentError(f"the replica sets {sets} must hold every rank of 0..{world - 1} once")
        smallest = _fewest_per_node(node_of_rank, sets)
        single_node = any(len({node_of_rank[r] for r in members}) < 2 for members in sets)
        if not 1 <= count <= max(smallest, 1):
            raise InvalidArgumentError(f"data-parallel shares must be between 1 and the members a replica set has "
                                       f"on a node, the ranks of the smallest node under DDP ({smallest}), got "
                                       f"{count}: each node must hold every share")
        if count > 1 and single_node:
            raise InvalidArgumentError(f"{count} data-parallel shares of a replica set on one node would keep one "
                                       "copy of each: a rank's death would lose its share. Use 1 share (a full copy "
                                       "per rank)")
        self.count = count
        self.total = count * len(sets)  # shares in the whole job
        self._share_of = [0] * world
        for index, members in enumerate(sets):
            by_node: "OrderedDict[Hashable, List[int]]" = OrderedDict()
            for rank in members:
                by_node.setdefault(node_of_rank[rank], []).append(rank)
            for ranks in by_node.values():
                for position, rank in enumerate(ranks):
                    self._share_of[rank] = index * count + position % count
        self._holders: List[List[int]] = [[] for _ in range(self.total)]
        for rank, share in enumerate(self._share_of):
            self._holders[share].append(rank)

    def share_of(self, rank: int) -> int:
        """The share ``rank`` snapshots (numbered across the job)."""
        return self._share_of[rank]

    def local(self, share: int) -> int:
        """``share``'s index among its replica set's shares: the store that keeps it."""
        return share % self.count

    def set_shares(self, rank: int) -> range:
        """The shares of ``rank``'s replica set: every one ``rank`` trains with."""
        first = self._share_of[rank] - self._share_of[rank] % self.count
        return range(first, first + self.count)

    def holders(self, share: int) -> List[int]:
        """The ranks that snapshot ``share``."""
        return list(self._holders[share])

    def split(self, nbytes: Sequence[int], alignment: int = 4096) -> List[List[Tuple[int, int, int]]]:
        """How to cut items of sizes ``nbytes`` (in order, as if laid end to end) into
        a replica set's shares (local indices): equal parts of the whole, a cut inside an item moved down to a
        multiple of ``alignment`` bytes (a multiple of any element size). Returns, per
        item, its pieces as (share, start byte, end byte). Deterministic, so every
        rank cuts the same tensors the same way; one large tensor is split too."""
        total = sum(nbytes)
        ends = [total * (share + 1) // self.count for share in range(self.count)]
        pieces, position = [], 0
        for size in nbytes:
            share = min(sum(1 for end in ends if end <= position), self.count - 1)
            item, start = [], 0
            for cut_share, end in enumerate(ends[:-1]):
                if not position < end < position + size:
                    continue
                cut = (end - position) // alignment * alignment
                if cut > start:
                    item.append((share, start, cut))
                    start = cut
                share = cut_share + 1
            item.append((share, start, size))
            pieces.append(item)
            position += size
        return pieces


def default_share_count(node_of_rank: Sequence[Hashable],
                        replica_sets: Optional[Sequence[Sequence[int]]] = None) -> int:
    """The most shares each replica set (default: every rank) can be cut into so that
    every node it spans keeps a full copy of it: the fewest members a set has on one
    of its nodes (the ranks of the smallest node under DDP; 1 under HSDP, one member
    per node), or 1 when a set lies on one node (a share would then have one copy)."""
    sets = [list(range(len(node_of_rank)))] if replica_sets is None else replica_sets
    if any(len({node_of_rank[r] for r in members}) < 2 for members in sets):
        return 1
    return _fewest_per_node(node_of_rank, sets)


def _fewest_per_node(node_of_rank: Sequence[Hashable], replica_sets: Sequence[Sequence[int]]) -> int:
    """The fewest members any replica set has on one of the nodes it spans."""
    fewest = None
    for members in replica_sets:
        per_node: Dict[Hashable, int] = {}
        for rank in members:
            per_node[node_of_rank[rank]] = per_node.get(node_of_rank[rank], 0) + 1
        fewest = min(per_node.values()) if fewest is None else min(fewest, *per_node.values())
    return fewest or 0

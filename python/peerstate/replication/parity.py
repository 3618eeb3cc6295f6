"""Erasure-coded parity groups (one loss per group, XOR): redundancy for state
that differs per rank at a fraction of a copy.

``ParityGroups`` says which ranks form a group: ranks of the same local index
on g different nodes (and, with racks, round-robin over the racks, as buddies
are), so that losing a whole node loses at most one member of any group.
``ParityLayout`` says where a member's bytes go: each member's shard is cut
into g - 1 pieces, piece t of member i folded into the parity that member
(i + 1 + t) mod g holds. Every member holds one parity block of 1/(g - 1) of
the largest shard in its group, computed from pieces of the *other* members
only, so no member holds parity of its own bytes. A lost member's piece t is
rebuilt by its holder from that parity and the other survivors' pieces of the
same version (``rebuild_piece``), one piece at each of the g - 1 holders at
once; the replacement then pulls g - 1 pieces from g - 1 sources.

What this saves and what it does not (see docs/snapshots-and-replication.md):
memory for others' state falls from a whole shard per copy to 1/(g - 1) of
one; the bytes a member pushes per version do not fall below its shard, as
every bit of a member's state must leave its node once for any parity held
elsewhere to cover it (buddies with k = 1 push the same). Two or more losses
in one group are beyond this code (``unrecoverable``): the job falls back to
its disk checkpoint. More losses per group (Reed-Solomon, m > 1) are not built.

The codec runs on the native ``ParityCoder`` (csrc/store/parity.h): buffers are
numpy uint8 arrays, passed to it as (pointer, nbytes).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from peerstate._C import ParityCoder, parity_pieces
from peerstate.errors import InvalidArgumentError
from peerstate.replication.placement import node_ring, warn_unseparated
from peerstate.state.snapshot import DEFAULT_CHUNK_BYTES, SnapshotStore



class ParityGroups:
    """Which ranks form each parity group.

    Args:
        node_of_rank: the node id of each rank (index = rank).
        group_size: g, the members of a group (2: a mirror, no saving; 4 or 8 are
            the usual). Where the ranks do not divide into groups of g on different
            nodes, groups have fewer; a rank that would be alone joins another group.
        rack_of_rank: optional rack id of each rank: groups spread over racks first.
        strict: raise instead of warning when a group cannot keep its members on
            different nodes.
    """

    def __init__(self, node_of_rank: Sequence[Hashable], group_size: int = 4,
                 rack_of_rank: Optional[Sequence[Hashable]] = None, strict: bool = False) -> None:
        world = len(node_of_rank)
        if group_size < 2:
            raise InvalidArgumentError(f"group_size must be at least 2 (got {group_size}): a group of one has "
                                       "nothing to rebuild from")
        if world < 2:
            raise InvalidArgumentError(f"parity groups need at least 2 ranks (got {world})")
        if rack_of_rank is not None and len(rack_of_rank) != world:
            raise InvalidArgumentError(f"rack_of_rank has {len(rack_of_rank)} entries for {world} ranks")
        self.node_of_rank = list(node_of_rank)
        self.group_size = group_size
        self.warnings: List[str] = []
        ranks_by_node: "OrderedDict[Hashable, List[int]]" = OrderedDict()
        for rank, node in enumerate(self.node_of_rank):
            ranks_by_node.setdefault(node, []).append(rank)
        ring = node_ring(ranks_by_node, rack_of_rank)
        if len(ring) == 1:
            warn_unseparated(self.warnings,
                             f"all {world} ranks are on one node ({ring[0]!r}): parity on the same node does not "
                             "survive it; use several nodes for real protection", strict)
        self.groups = self._form(ring, ranks_by_node)
        singles = [g[0] for g in self.groups if len(g) == 1]  # a group of one rebuilds nothing
        self.groups = [g for g in self.groups if len(g) > 1]
        if not self.groups:
            self.groups, singles = [singles[:2]], singles[2:]
        for alone in singles:
            apart = [g for g in self.groups if self.node_of_rank[alone] not in {self.node_of_rank[m] for m in g}]
            if not apart and len(ring) > 1:
                warn_unseparated(self.warnings,
                                 f"rank {alone} has no group without a member on its node "
                                 f"({self.node_of_rank[alone]!r}): losing that node loses two members of its "
                                 "group", strict)
            min(apart or self.groups, key=len).append(alone)
        self._group_of = {rank: index for index, group in enumerate(self.groups) for rank in group}
        if group_size > 2 and any(len(g) == 2 for g in self.groups):
            warn_unseparated(self.warnings,
                             f"some groups have 2 members, not {group_size}: each of them holds a whole copy of "
                             "the other (the nodes and their ranks do not divide into larger groups on different "
                             "nodes)", strict=False)

    def _form(self, ring: List[Hashable], ranks_by_node: "OrderedDict[Hashable, List[int]]") -> List[List[int]]:
        """Groups as consecutive runs of the ranks ordered by (local index, ring position):
        runs of one local index on neighbouring nodes, so racks alternate within a group.
        Where uneven nodes make a run hold two ranks of one node, the ranks are dealt out
        node by node instead, which separates them whenever there are at least as many
        groups as the most ranks a node has."""
        world = len(self.node_of_rank)
        most = max(len(ranks) for ranks in ranks_by_node.values())
        count = max(math.ceil(world / self.group_size), most if len(ring) > 1 else 1)
        ordered = [ranks_by_node[node][local] for local in range(most) for node in ring
                   if local < len(ranks_by_node[node])]
        bounds = [world * i // count for i in range(count + 1)]
        runs = [ordered[bounds[i]:bounds[i + 1]] for i in range(count)]
        if all(len({self.node_of_rank[r] for r in run}) == len(run) for run in runs) or len(ring) == 1:
            return runs
        dealt: List[List[int]] = [[] for _ in range(count)]
        for position, rank in enumerate(r for node in ring for r in ranks_by_node[node]):
            dealt[position % count].append(rank)
        return dealt

    def group_of(self, rank: int) -> List[int]:
        """The members of ``rank``'s group, in layout order (``rank`` included)."""
        return list(self.groups[self._group_of[rank]])

    def holders(self, rank: int) -> List[int]:
        """The ranks whose parity covers ``rank``'s pieces: the other members."""
        return [m for m in self.group_of(rank) if m != rank]

    def unrecoverable(self, dead: Sequence[int]) -> List[List[int]]:
        """The groups that lost more than one member among ``dead`` (nothing rebuilds them)."""
        dead_set = set(dead)
        return [list(g) for g in self.groups if len(dead_set.intersection(g)) > 1]

    def describe_loss(self, dead: Sequence[int]) -> Optional[str]:
        """What a loss of ``dead`` leaves unrecoverable, naming each group (None: nothing)."""
        dead_set = set(dead)
        lost = [(g, sorted(dead_set.intersection(g))) for g in self.unrecoverable(dead)]
        if not lost:
            return None
        parts = [f"group of ranks {g} lost ranks {', '.join(map(str, d))}" for g, d in lost]
        return ("; ".join(parts) + ": parity rebuilds one member per group, so their state has no surviving copy "
                "and the job falls back to its disk checkpoint")


class ParityPlacement:
    """Parity groups in the place of buddies (``Job(parity_group=g)``), with the part of
    ``BuddyPlacement``'s interface the worker and the planner use: a rank pushes its pieces
    to the other members of its group (``holders``), is rebuilt from them (``sources``),
    and holds no replica of anyone (``served_by`` is empty: it holds its group's parity
    block instead, ``Replication.hold_parity``)."""

    parity = True  # the planner's test: parity groups, not buddies

    def __init__(self, node_of_rank: Sequence[Hashable], group_size: int) -> None:
        self.groups = ParityGroups(node_of_rank, group_size)
        small = [g for g in self.groups.groups if len(g) < 3]
        if small:
            raise InvalidArgumentError(
                f"parity groups of {group_size} over {len(node_of_rank)} ranks leave groups of fewer than 3 "
                f"({small}): a group of 2 is a mirror; use buddies (k=1) or a group size that divides the ranks")
        self.group_size = group_size

    def group_of(self, rank: int) -> List[int]:
        return self.groups.group_of(rank)

    def holders(self, rank: int) -> List[int]:
        return self.groups.holders(rank)

    def sources(self, rank: int) -> List[int]:
        return self.groups.holders(rank)

    def served_by(self, holder: int) -> List[int]:
        return []

    def replica_group(self, rank: int) -> List[int]:
        return [rank]


def largest_piece(store: SnapshotStore, group_size: int) -> int:
    """The bytes of the largest of the g - 1 pieces the next snapshot of ``store`` is cut
    into (``_C.parity_pieces``): every member of a group holds blocks of the largest of
    its members' largest pieces."""
    return max(nbytes for _first, _end, _offset, nbytes in parity_pieces(store.native, None, group_size))


class ParityLayout:
    """Where a group's bytes go, as the job cuts them (``parity_piece`` in
    csrc/store/parity.h, for a shard of one buffer): ``sizes[i]`` bytes of one version
    of member i (group order), in chunks of ``chunk_bytes`` (the unit of transfer and of
    checksums), cut into g - 1 pieces of whole chunks, piece t holding the chunks c with
    floor(c (g - 1) / C) == t. A holder's block has the bytes of the largest piece
    (``piece_bytes``): 1/(g - 1) of the largest shard, rounded up to a chunk."""

    def __init__(self, sizes: Sequence[int], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if len(sizes) < 2 or min(sizes) < 0 or chunk_bytes < 64:
            raise InvalidArgumentError(f"a parity layout needs 2 or more members of >= 0 bytes and chunks of 64 "
                                       f"bytes or more (got {list(sizes)}, {chunk_bytes})")
        self.sizes = list(sizes)
        self.members = len(sizes)
        self.chunk_bytes = chunk_bytes
        self.piece_bytes = max(self.piece(m, p)[1] for m in range(self.members) for p in range(self.members - 1))

    def holder(self, member: int, piece: int) -> int:
        """The member whose parity piece ``piece`` of ``member`` is folded into."""
        return (member + 1 + piece) % self.members

    def piece(self, member: int, piece: int) -> Tuple[int, int]:
        """(offset, nbytes) of ``member``'s piece in its shard (nbytes 0 for an empty one)."""
        size, pieces = self.sizes[member], self.members - 1
        count = -(-size // self.chunk_bytes)
        first, end = (-(-p * count // pieces) for p in (piece, piece + 1))
        start = min(size, first * self.chunk_bytes)
        return start, min(size, end * self.chunk_bytes) - start

    def folded_into(self, holder: int) -> List[Tuple[int, int]]:
        """(member, piece) of every piece ``holder``'s parity is the XOR of."""
        return [(m, (holder - m - 1) % self.members) for m in range(self.members) if m != holder]

    def pushed_bytes(self, member: int) -> int:
        """Bytes ``member`` sends per version: each piece to its holder (its whole shard)."""
        return self.sizes[member]

    def held_bytes(self) -> int:
        """Bytes of one parity block, what each member holds per version of its group's."""
        return self.piece_bytes


def _span(array: np.ndarray, offset: int = 0, nbytes: Optional[int] = None) -> Tuple[int, int]:
    if array.dtype != np.uint8 or not array.flags.c_contiguous:
        raise InvalidArgumentError(f"parity buffers are contiguous uint8 arrays (got {array.dtype}, contiguous="
                                   f"{array.flags.c_contiguous}): pass np.frombuffer(...) or .view(np.uint8)")
    nbytes = array.nbytes - offset if nbytes is None else nbytes
    return array.ctypes.data + offset, nbytes


def _check_shards(layout: ParityLayout, shards: Sequence[Optional[np.ndarray]], absent: Sequence[int]) -> None:
    if len(shards) != layout.members:
        raise InvalidArgumentError(f"{len(shards)} shards for a group of {layout.members}")
    for member, shard in enumerate(shards):
        if member in absent:
            continue
        if shard is None or shard.nbytes != layout.sizes[member]:
            raise InvalidArgumentError(f"member {member}'s shard has {None if shard is None else shard.nbytes} bytes, "
                                       f"the layout {layout.sizes[member]}: every shard must be of the same version")


def encode(coder: ParityCoder, layout: ParityLayout, holder: int, shards: Sequence[Optional[np.ndarray]],
           out: Optional[np.ndarray] = None) -> np.ndarray:
    """``holder``'s parity block from the other members' shards (its own may be None).
    Written into ``out`` (``layout.held_bytes()`` uint8) when given, else a new array."""
    _check_shards(layout, shards, absent=[holder])
    parity = np.empty(layout.held_bytes(), np.uint8) if out is None else out
    if parity.nbytes != layout.held_bytes():
        raise InvalidArgumentError(f"a parity block has {layout.held_bytes()} bytes, not {parity.nbytes}")
    sources = [_span(shards[m], *layout.piece(m, p)) for m, p in layout.folded_into(holder)]
    coder.xor_blocks(_span(parity), sources)
    return parity


def rebuild_piece(coder: ParityCoder, layout: ParityLayout, lost: int, holder: int,
                  shards: Sequence[Optional[np.ndarray]], parity: np.ndarray, out: np.ndarray) -> None:
    """What ``holder`` does at a recovery: ``lost``'s piece folded into its ``parity``,
    from that parity and the other survivors' shards (``shards[lost]`` and
    ``shards[holder]`` unused), written to ``out`` (exactly the piece's bytes)."""
    _check_shards(layout, shards, absent=[lost, holder])
    piece = (holder - lost - 1) % layout.members
    _, nbytes = layout.piece(lost, piece)
    if out.nbytes != nbytes or parity.nbytes != layout.held_bytes():
        raise InvalidArgumentError(f"piece {piece} of member {lost} has {nbytes} bytes (out has {out.nbytes}); "
                                   f"a parity block {layout.held_bytes()} (got {parity.nbytes})")
    sources = [_span(parity, 0, nbytes)]
    for member, member_piece in layout.folded_into(holder):
        if member != lost:
            offset, length = layout.piece(member, member_piece)
            sources.append(_span(shards[member], offset, min(length, nbytes)))
    coder.xor_blocks(_span(out), sources)


def rebuild(coder: ParityCoder, layout: ParityLayout, lost: int, shards: Sequence[Optional[np.ndarray]],
            parities: Sequence[Optional[np.ndarray]], out: Optional[np.ndarray] = None) -> np.ndarray:
    """``lost``'s whole shard from the survivors' shards and parities (those of ``lost``
    may be None), every holder's piece in turn, into ``out`` (``layout.sizes[lost]``
    uint8: a replacement's memory, allocated beforehand) or a new array."""
    shard = np.empty(layout.sizes[lost], np.uint8) if out is None else out
    if shard.nbytes != layout.sizes[lost]:
        raise InvalidArgumentError(f"member {lost}'s shard has {layout.sizes[lost]} bytes, not {shard.nbytes}")
    for piece in range(layout.members - 1):
        holder = layout.holder(lost, piece)
        offset, nbytes = layout.piece(lost, piece)
        if nbytes:
            parity = parities[holder]
            if parity is None:
                raise InvalidArgumentError(f"member {holder}'s parity is needed to rebuild member {lost}")
            rebuild_piece(coder, layout, lost, holder, shards, parity, shard[offset:offset + nbytes])
    return shard

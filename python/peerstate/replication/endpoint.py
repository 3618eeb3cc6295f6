"""Buddy replication for one rank: serve the buddies' replicas, push this rank's
snapshots to its holders, pull a lost rank's state back. One native server and
one transport per rank serve and pull every store the rank keeps: its own state
and, with data-parallel shares, the share it snapshots (``serve_share``).

Wiring (one per rank, after the SnapshotStore is registered)::

    repl = Replication(store, rank, placement, credentials=credentials, host="10.0.0.5")
    publish(rank, repl.address)                       # e.g. through the job's TCPStore
    repl.connect({r: address_of(r) for r in range(world)})
    repl.reserve({r: bytes_per_version_of(r) for r in placement.served_by(rank)})
    for step in ...:
        store.snapshot(step).wait()
        repl.replicate(step)                          # background; next snapshot waits for it

A replacement for rank r registers the same buffers, then ``repl.recover(r)``.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from peerstate import _C
from peerstate.errors import InvalidArgumentError, NotFoundError
from peerstate.replication.placement import BuddyPlacement
from peerstate.replication.stopped_holder import OWN_STATE, REPLICAS, SHARES, StoppedHolder
from peerstate.state.snapshot import SnapshotStore

Address = Tuple[str, int]

# How many snapshots past this rank's step a replica held here may be pushed
# (``Replication.reached``): the ranks of one job are a step or two apart.
VERSION_WINDOW_SNAPSHOTS = 64


class PullStats(NamedTuple):
    """What one pull moved: the version, its chunks, and how many of them were read
    straight from a same-machine holder's memory."""

    version: int
    chunks: int
    chunks_from_memory: int


class Replication:
    """This rank's replication endpoint (server, transport and replicator).

    Args:
        store: this rank's SnapshotStore (checksums on).
        rank: this rank.
        placement: the job's BuddyPlacement (the same on every rank).
        credentials: this rank's ``_C.Credentials``, from its agent (a worker's
            environment: ``WorkerEnvironment``) or from ``_C.JobAuthority(secret).issue(rank)``
            where the job secret is at hand; every peer proves its own.
        host: the address to listen on; loopback by default, never all
            interfaces unless "0.0.0.0" is given.
        port: 0 picks a free port.
        connections_per_peer: parallel TCP connections to each peer.
        replica_budget_bytes: bound on the replicas held here (default: half of RAM).
        replica_device: hold the replicas in the memory of this CUDA device instead of
            host memory (GPU nodes; give replica_budget_bytes too).
        io_timeout: seconds a transfer step may take before it fails; also how long the
            server keeps an idle connection.
        protection: how frames are protected after the handshake, the same on every
            rank: "authenticated" (default: an AES-256-GCM tag on every frame),
            "encrypted" (and payloads encrypted), or "trusted-fabric" (no per-frame
            protection: only for a network whose every host is trusted).
        snapshot_every: the job's steps per snapshot; versions pushed here are bounded
            by ``VERSION_WINDOW_SNAPSHOTS`` snapshots past this rank's step (``reached``).
    """

    def __init__(
        self,
        store: SnapshotStore,
        rank: int,
        placement: BuddyPlacement,
        *,
        credentials: "_C.Credentials",
        host: str = "127.0.0.1",
        port: int = 0,
        connections_per_peer: int = 4,
        replica_budget_bytes: Optional[int] = None,
        replica_device: Optional[int] = None,
        io_timeout: float = 30.0,
        protection: str = "authenticated",
        snapshot_every: int = 1,
    ) -> None:
        if not store.native.checksums:
            raise InvalidArgumentError("replication verifies every chunk: create the SnapshotStore with checksums=True")
        if credentials.rank != rank:
            raise InvalidArgumentError(f"credentials of rank {credentials.rank} given to rank {rank}'s replication: "
                                       "a rank proves only its own (its agent issues them)")
        self.store = store
        self.rank = rank
        self.placement = placement
        self.host = host
        self.version_window = VERSION_WINDOW_SNAPSHOTS * snapshot_every
        io_ms = self._io_ms = int(io_timeout * 1000)
        self.replicas = _C.ReplicaStore(budget_bytes=replica_budget_bytes or 0,
                                        device=-1 if replica_device is None else replica_device)
        self.server = _C.TcpServer(self.replicas, store.native, credentials=credentials, host=host, port=port,
                                   io_timeout_ms=io_ms, protection=protection)
        self._transport_options = dict(credentials=credentials, connections_per_peer=connections_per_peer,
                                       connect_timeout_ms=min(io_ms, 5000), io_timeout_ms=io_ms,
                                       protection=protection)
        self._addresses: Dict[int, Address] = {}
        # The last pull(): its chunks, and how many were read from a same-machine holder's memory.
        self.last_pull = {"chunks": 0, "chunks_from_memory": 0}
        self.transport = _C.TcpTransport(**self._transport_options)
        self.replicator = _C.Replicator(store.native, self.transport, rank)
        self._index: Optional["_C.ProcessIndex"] = None  # see index_stores
        self._stopped: Optional[StoppedHolder] = None  # the hung predecessor this replacement adopted
        self._release_once_replicated: Optional[Callable[[], None]] = None  # see release_once_replicated
        self._adopted_own: Set[int] = set()  # its own versions copied from there (see adopt)
        self._adopted_share: List[int] = []  # versions of its data-parallel share copied from there
        self._shares: Dict[int, SnapshotStore] = {}  # share -> the store this rank keeps it in
        self._share_replicators: Dict[int, "_C.Replicator"] = {}
        self.parity: Optional["_C.ParityStore"] = None  # see hold_parity
        store.add_pre_snapshot_hook(self._wait_before_snapshot)

    @property
    def address(self) -> Address:
        """Where this rank's replication server listens."""
        return (self.host, self.server.port)

    def connect(self, addresses: Dict[int, Address]) -> None:
        """Tell the transport where every peer listens (connections open on first use)."""
        for peer, (host, port) in addresses.items():
            if peer != self.rank:
                self._addresses[peer] = (host, port)
                self.transport.add_peer(peer, host, port)

    def abort_transfers(self) -> None:
        """Fail every transfer in flight now (thread-safe; a recovery's first act).
        The transport stays unusable until reset()."""
        self.transport.abort()
        if self.parity is not None:  # a round's wait for its own block, which no transport abort ends
            self.parity.interrupt_waits()

    def reset(self) -> None:
        """After abort_transfers(): end the round in flight and start over with a fresh
        transport (same peers; connect() replaces the addresses that changed). The
        server and the replicas it holds are kept."""
        self.abort_transfers()
        self._wait_in_flight()
        self.transport = _C.TcpTransport(**self._transport_options)
        self.replicator = _C.Replicator(self.store.native, self.transport, self.rank)
        self._share_replicators = {share: _C.Replicator(store.native, self.transport, self.rank)
                                   for share, store in self._shares.items()}
        if self.parity is not None:
            self.parity.resume_waits()
        self.connect(self._addresses)

    def serve_share(self, share: int, store: SnapshotStore) -> None:
        """Serve data-parallel ``share``, kept in ``store``, from this rank's server, and
        pull it into ``store`` with ``pull_share``. Data-parallel state has no buddies
        (every rank keeps the same state): a share is never pushed. Idempotent."""
        if self._shares.get(share) is store:
            return
        if share in self._shares:
            raise InvalidArgumentError(f"data-parallel share {share} is already served from another store")
        self.server.serve(1 + share, store.native)
        if self._index is not None:
            store.native.index_into(self._index, SHARES + share, self.rank)
        self._shares[share] = store
        self._share_replicators[share] = _C.Replicator(store.native, self.transport, self.rank)

    def index_stores(self) -> int:
        """List this rank's own committed versions and the replicas it holds in a
        ``_C.ProcessIndex`` from now on, and return its address (see ``stopped_holder``):
        if this process hangs, its replacement on the node reads them from its memory."""
        if self._index is None:
            self._index = _C.ProcessIndex()
            self.store.native.index_into(self._index, OWN_STATE, self.rank)
            self.replicas.index_into(self._index, REPLICAS)
            for share, store in self._shares.items():
                store.native.index_into(self._index, SHARES + share, self.rank)
        return self._index.address

    def adopt(self, holder: StoppedHolder, share: Optional[int] = None) -> Tuple[Dict[int, List[int]], List[int],
                                                                             List[str]]:
        """Take over what this rank's stopped predecessor ``holder`` held, now: its
        replicas into this rank's ReplicaStore, the versions of data-parallel ``share``
        it kept into this rank's store of that share, and, once this rank's buffers are
        registered, its own versions into this rank's SnapshotStore (``pull(self.rank,
        v)`` then finds them there; before that it reads them from ``holder``). Every
        version, not only the one a recovery needs: if this rank is lost in turn, the
        recovery point may be an older one its buddies' replicas share. Returns (source
        -> replica versions adopted, share versions adopted, why any was not)."""
        self._stopped = holder
        replicas, refused = holder.adopt_replicas(self.replicas)
        shares: List[int] = []
        for version in sorted(holder.shares.get(share, {})) if share is not None else []:
            try:
                self.pull_share(share, version, [])
                shares.append(version)
            except Exception as error:  # noqa: BLE001 - said, and that version is not claimed
                refused.append(f"version {version} of data-parallel share {share}: {error}")
        for version in sorted(holder.own) if self.store.native.buffer_names() else []:
            try:
                self._pull(self.replicator, [], version, {}, f"rank {self.rank}", holder.own_source(version))
                self._adopted_own.add(version)
            except Exception as error:  # noqa: BLE001 - read from the stopped process at the pull instead
                refused.append(f"version {version} of rank {self.rank}'s own state: {error}")
        self._adopted_share = shares
        return replicas, shares, refused

    @property
    def stopped_holder(self) -> Optional[StoppedHolder]:
        """The stopped predecessor ``adopt`` took over, until ``release_stopped``."""
        return self._stopped

    @property
    def adopted_share(self) -> List[int]:
        """The versions of its data-parallel share ``adopt`` took, until ``release_stopped``."""
        return self._adopted_share

    def release_stopped(self) -> None:
        """Read nothing more from the stopped predecessor (it is about to be killed)."""
        self._stopped = None
        self._adopted_own.clear()
        self._adopted_share = []

    def release_once_replicated(self, release: Callable[[], None]) -> None:
        """Call ``release`` (which lets the stopped predecessor be killed) once this rank's
        state is held elsewhere again: when a round lands on every holder (``wait``), or
        now if it has none (data-parallel state). Until then the predecessor is the only
        other copy of what this replacement took from it: a replacement killed between
        its pull and its first round would otherwise lose the rank's state, and its own
        replacement reads the predecessor again (it stays named in the node channel)."""
        if self._stopped is None:
            return
        if self.placement.holders(self.rank):
            self._release_once_replicated = release
        else:
            release()

    def reserve(self, bytes_per_version: Dict[int, int]) -> None:
        """Account the replicas this rank will hold (rank -> bytes of one version) against
        its budget, now rather than mid-run. Raises BudgetExceededError."""
        for source, nbytes in bytes_per_version.items():
            self.replicas.reserve(source, nbytes)

    def replicate(self, version: int) -> None:
        """Send committed ``version`` to this rank's holders in the background (its parity
        group's members, once ``hold_parity`` made it a member of one: ``push_pieces``).
        Waits first for the previous round (at most one in flight)."""
        if self.parity is not None:
            self.push_pieces(version)
        else:
            self.replicator.replicate(version, self.placement.holders(self.rank))

    def wait(self, version: int, *, check: bool = True) -> Dict[int, Optional[BaseException]]:
        """Block until ``version``'s round ends; return holder -> None (committed there) or
        the error. With ``check``, raise the first error."""
        results = dict(self.replicator.wait(version))
        if self._release_once_replicated is not None and results and all(e is None for e in results.values()):
            release, self._release_once_replicated = self._release_once_replicated, None
            release()
        if check:
            for holder, error in results.items():
                if error is not None:
                    raise type(error)(f"replication of version {version} to rank {holder} failed: {error}")
        return results

    def pull(self, rank: int, version: int = -1, sources: Optional[List[int]] = None,
             same_machine: Optional[Dict[int, Tuple[int, int]]] = None) -> int:
        """Fetch ``rank``'s state (``version``, or the newest its first source has) from its
        sources, chunks split among them, into this rank's store as a committed version
        (replacing the store's copy of it, and any newer version, if it has one).
        Does not restore it. Returns the version.

        ``same_machine``: source -> (pid, region address of ``version`` there) for sources
        on this machine: their chunks are read straight from their memory, and only what
        that cannot provide (not permitted, process gone) travels over TCP."""
        if rank == self.rank and version in self._adopted_own & set(self.store.native.committed_versions()):
            self.last_pull = {"chunks": 0, "chunks_from_memory": 0}
            return version  # adopted from the stopped predecessor, every chunk verified then
        peers = self.placement.sources(rank) if sources is None else sources
        group = set(self.placement.replica_group(rank))
        local = same_machine or {}
        stopped = None
        if rank == self.rank and self._stopped is not None and version in self._stopped.own:
            stopped = self._stopped.own_source(version)
        pulled = self._pull(self.replicator, [(p, p if p in group else rank, 0) for p in peers], version, local,
                            f"rank {rank}", stopped)
        self.last_pull = {"chunks": pulled.chunks, "chunks_from_memory": pulled.chunks_from_memory}
        return pulled.version

    def pull_share(self, share: int, version: int, sources: List[int],
                   same_machine: Optional[Dict[int, Tuple[int, int]]] = None) -> PullStats:
        """Fetch ``version`` of data-parallel ``share`` from the members in ``sources``
        (each serves its own copy of it) into the store ``serve_share`` gave, as
        ``pull`` does; also from the stopped predecessor ``adopt`` took over, when it
        kept that share at that version. Thread-safe across shares."""
        if share not in self._shares:
            raise InvalidArgumentError(f"data-parallel share {share} is not kept here: serve_share() it first")
        stopped = None
        if self._stopped is not None and version in self._stopped.shares.get(share, {}):
            stopped = self._stopped.share_source(share, version)
        return self._pull(self._share_replicators[share], [(p, p, 1 + share) for p in sources], version,
                          same_machine or {}, f"data-parallel share {share}", stopped)

    def _pull(self, replicator: "_C.Replicator", sources: List[Tuple[int, int, int]], version: int,
              same_machine: Dict[int, Tuple[int, int]], what: str,
              stopped: Optional[Tuple[int, int, bytes]] = None) -> PullStats:
        """(peer, rank asked for, store index) sources, peers on this machine read from memory;
        ``stopped``: (pid, region, metadata) of this rank's own version in its stopped
        predecessor, read first."""
        pulls = []
        for peer, rank, store in sources:
            if peer == self.rank:
                continue
            pid, region = same_machine.get(peer, (0, 0))
            pulls.append(_C.PullSource(peer, rank, store=store, pid=pid, region=region))
        meta = None
        if stopped is not None:
            pid, region, meta = stopped
            pulls.insert(0, _C.PullSource(self.rank, self.rank, pid=pid, region=region))
        if not pulls:
            raise InvalidArgumentError(f"{what} has no source other than this rank")
        return PullStats(*replicator.pull(pulls, version, meta))

    def recover(self, rank: int, version: int = -1, sources: Optional[List[int]] = None) -> int:
        """pull() then restore into the registered buffers, without a second checksum
        pass (every chunk was verified as it arrived). Returns the version restored."""
        pulled = self.pull(rank, version, sources)
        self.store.restore(pulled, verify=False)
        return pulled

    def hold_parity(self, members: Sequence[int], block_bytes: int, budget_bytes: Optional[int] = None) -> None:
        """Join the parity group ``members`` (ranks in group order, this rank among them; see
        ``ParityGroups``): hold its parity in blocks of ``block_bytes``, the largest piece any
        member pushes (``largest_piece``), two blocks at most. Raises BudgetExceededError."""
        if self.rank not in members:
            raise InvalidArgumentError(f"rank {self.rank} is not in the parity group {list(members)}")
        if self.parity is None:  # the server keeps the store it is given: a later call regroups that one
            self.parity = _C.ParityStore(budget_bytes=budget_bytes or 0)
            self.server.hold_parity(self.parity)
        self.parity.hold(list(members), list(members).index(self.rank), block_bytes)

    def push_pieces(self, version: int) -> None:
        """Send committed ``version`` to this rank's parity group, one piece to each other
        member, in the background, as ``replicate`` does for buddies (``wait`` ends it: each
        member's outcome, this rank's own included, is ok once the version's block is
        complete there; see ``_C.Replicator.push_pieces``)."""
        members, self_index = self._parity_group()
        self.replicator.push_pieces(version, members, self_index, self.parity, self._io_ms)

    def rebuild_piece(self, lost: int, version: int) -> None:
        """At a holder: rebuild the piece of ``lost``'s ``version`` this rank keeps parity
        of, from its block and the other survivors' own snapshots, and keep it for the
        replacement (``pull_pieces``) until ``forget_rebuilt``."""
        self._parity_group()
        self.replicator.rebuild_piece(self.parity, lost, version)

    def pull_pieces(self, rank: int, version: int, members: Optional[Sequence[int]] = None,
                    wait: float = 0.0) -> int:
        """At ``rank``'s replacement: pull its ``version`` from the pieces the other members
        of its group (``members``, in group order; default: the group this rank holds parity
        for) rebuilt, into this rank's store, committed (not restored). Returns the version.

        ``wait``: seconds to keep asking while no holder has rebuilt it yet. The holders
        rebuild as their part of the same recovery, at the same time as this pull starts;
        the first asks may come before their rebuild is done (a rebuild is one piece's
        transfer: the asks are a few, spaced 10 ms apart and more)."""
        members = list(members) if members is not None else self._parity_group()[0]
        if rank not in members:
            raise InvalidArgumentError(f"rank {rank} is not in the parity group {members}")
        deadline, pause = time.monotonic() + wait, 0.01
        while True:
            try:
                return self.replicator.pull_pieces(members, members.index(rank), version)
            except NotFoundError:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.2)

    def parity_versions(self) -> List[int]:
        """The versions whose parity block is complete here (none outside a group)."""
        return list(self.parity.committed()) if self.parity is not None else []

    def forget_rebuilt(self) -> None:
        """Free the pieces this holder rebuilt (once their replacements pulled them)."""
        if self.parity is not None:
            self.parity.forget_rebuilt()

    def _parity_group(self) -> Tuple[List[int], int]:
        if self.parity is None:
            raise InvalidArgumentError(f"rank {self.rank} is in no parity group: hold_parity() first")
        return list(self.parity.members), self.parity.index

    def drop_newer(self, version: int) -> None:
        """After the job rolled back to ``version``: forget the replicas newer than it (of
        the abandoned run), so that the re-run's versions, with the same numbers, land;
        the job is at ``version`` again (``reached``)."""
        self.replicas.drop_newer(version)
        if self.parity is not None:
            self.parity.drop_newer(version)
        if version >= 0:
            self.reached(version)

    def reached(self, step: int) -> None:
        """This rank's job is at ``step``: the replicas it holds may not be pushed further
        than ``version_window`` steps past it. The window is the job's own record of how
        far any member can be ahead of this one (every step has collectives, so members
        are a step or two apart; snapshot_every widens it), so a member holding the job
        secret cannot ratchet a replica's version beyond what a real step will reach."""
        self.replicas.bound_versions(step + self.version_window)
        if self.parity is not None:
            self.parity.bound_versions(step + self.version_window)

    def holdings(self) -> Dict[int, int]:
        """source rank -> the newest version committed here."""
        return {source: max(versions) for source, versions in self.held_versions().items()}

    def held_versions(self) -> Dict[int, List[int]]:
        """source rank -> every version readable here: the newest, and the one before
        it until an incoming version reuses its memory."""
        held: Dict[int, List[int]] = {}
        for source, version in self.replicas.committed():
            held.setdefault(source, []).append(version)
        return held

    def close(self) -> None:
        """Stop serving, abort transfers, wait for the round in flight."""
        self.transport.abort()
        self.server.stop()

    def _wait_in_flight(self) -> None:
        version = self.replicator.in_flight_version()
        if version is not None:
            self.replicator.wait(version)

    def _wait_before_snapshot(self) -> None:
        """The next snapshot may reuse the slot of any version but the newest committed
        one: wait for the round in flight only when it sends an older version. The
        usual round (the newest, started before optimizer.step()) then goes on during
        the next step instead of holding up this step's end."""
        version = self.replicator.in_flight_version()
        if version is None:
            return
        native = self.store.native
        versions = [*native.committed_versions(), native.in_flight_version()]
        if version < max((v for v in versions if v is not None), default=version + 1):
            self.replicator.wait(version)

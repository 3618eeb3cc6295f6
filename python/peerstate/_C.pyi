"""peerstate._C: the native core (C++17, optional CUDA). Bindings only convert
types, release the GIL around anything that blocks, and raise the exceptions
below from native status codes."""

from typing import Any, Dict, List, Optional, Tuple

class Error(Exception): ...
class InvalidArgumentError(Error, ValueError): ...
class NotFoundError(Error, LookupError): ...
class ChecksumMismatchError(Error): ...
class RegistrationMismatchError(Error): ...
class BudgetExceededError(Error): ...
class BusyError(Error): ...
class UnavailableError(Error): ...
class CudaError(Error): ...
class TimeoutError(Error, TimeoutError): ...
class AbortedError(Error): ...
class PeerConnectionError(Error, ConnectionError): ...
class AuthenticationError(Error): ...
class ProtocolError(Error): ...
class OutOfMemoryError(Error, MemoryError): ...
class InternalError(Error): ...

# (value, code, exception name, builtin base or "", doc) for every status code but
# kOk: the one table of csrc/common/status.h, which the classes above follow.
status_codes: List[Tuple[int, str, str, str, str]]

class BufferRegistration:
    """One buffer to register: `pointer` to `nbytes` of memory on `device` (-1: host);
    `dtype` is a tag compared on restore, never parsed. The memory stays the caller's."""

    def __init__(self, name: str, pointer: int, nbytes: int, device: int = -1, dtype: str = "") -> None: ...
    name: str
    pointer: int
    nbytes: int
    device: int
    dtype: str

class SnapshotStore:
    """Versioned, checksummed copies of registered buffers (see csrc/store/snapshot_store.h).
    Every store of a process with the same `threads` copies on one shared thread pool.

    Mutating calls must come from one thread at a time. Registered memory is
    the caller's and must stay valid until unregistered or closed.
    """

    def __init__(
        self,
        *,
        threads: int = 0,
        chunk_bytes: int = 4 << 20,
        max_versions: int = 2,
        budget_bytes: int = 0,
        checksums: bool = True,
    ) -> None: ...
    def register_buffers(self, buffers: List[BufferRegistration]) -> None:
        """Add or replace buffers, all or nothing.
        Raises BusyError while a version is in flight, BudgetExceededError,
        UnavailableError for device memory without CUDA."""
    def unregister(self, names: List[str]) -> None: ...
    def snapshot(self, version: int, after_stream: int = 0, gated: bool = False) -> None:
        """Start copying as `version` and return; waits first for a version in flight.
        gated=True: host chunks wait for validated(); device buffers are queued at once."""
    def validated(self, count: int) -> None:
        """The first `count` host buffers (buffer_names() order) of the gated version in
        flight were checked: copy them. Never blocks."""
    def cancel(self) -> None:
        """Cancel the version in flight (if any) and wait for its copies to stop."""
    def buffer_names(self) -> List[str]:
        """Registered names in layout order: host buffers first, then device ones."""
    def region_address(self, version: int) -> int:
        """Address of the slot holding `version` (committed or in flight) in this process; 0 if none.
        For a puller on this machine (Replicator.pull's pid/region sources)."""
    def index_into(self, index: ProcessIndex, tag: int, rank: int) -> None:
        """From now on, list this store's committed versions in `index` as store `tag` of `rank`."""
    def wait(self) -> None:
        """Block (GIL released) until the version in flight commits; raise its error."""
    def restore(self, version: int, verify: bool = True) -> int:
        """Verify (unless verify=False: a version just received, verified on arrival), then copy a
        committed version into the buffers; nothing written on error. Host chunks equal to the
        live bytes are skipped. Returns the bytes written."""
    def drop_newer(self, version: int) -> None:
        """Cancel the in-flight version and forget committed versions newer than
        ``version``; the buffers are not touched."""
    def allocate(self) -> None:
        """Allocate and fault in every version slot now, not on the first snapshots."""
    def close(self) -> None: ...
    def committed_versions(self) -> List[int]: ...
    def in_flight_version(self) -> Optional[int]: ...
    def memory(self) -> Dict[str, Any]: ...
    def version_info(self, version: int) -> Dict[str, Any]:
        """{version, nbytes, chunk_bytes, buffers: [(name, nbytes, device, offset, dtype)],
        chunks: [(offset, nbytes, device)], checksums: [crc32c per chunk]}"""
    def stored_bytes(self, version: int) -> memoryview:
        """Writable view of a committed version's bytes, valid until its slot is reused."""
    @property
    def threads(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def max_versions(self) -> int: ...
    @property
    def budget_bytes(self) -> int: ...
    @property
    def checksums(self) -> bool: ...

def cuda_compiled() -> bool: ...
def cuda_available() -> bool: ...
def cuda_device_count() -> int: ...

class LivenessTicker:
    """Stores an increasing count into the 8-byte word at `offset` of the file at
    `path` from a native thread, every `interval_seconds`: it stops when the process
    is not scheduled (frozen, or starved), never for the GIL. Freeing the object does
    not stop it: it ticks until the process is gone (csrc/common/liveness_ticker.h)."""

    def __init__(self, path: str, offset: int, interval_seconds: float) -> None: ...
    def stop(self) -> None:
        """End the thread (blocks up to one interval); idempotent."""
    @property
    def count(self) -> int: ...

class ReplicaStore:
    """The buddies' snapshots held here: per source rank, the committed version and at
    most one incoming one (see csrc/store/replica_store.h). Thread-safe."""

    def __init__(self, *, budget_bytes: int = 0, device: int = -1) -> None:
        """device -1: host memory; a CUDA index: device memory (explicit budget needed)."""
    @property
    def device(self) -> int: ...
    def reserve(self, source_rank: int, bytes_per_version: int) -> None:
        """Account 2 versions of `source_rank`; BudgetExceededError if over budget."""
    def committed(self) -> List[Tuple[int, int]]: ...
    def drop_newer(self, version: int) -> None:
        """Forget every source's versions newer than `version` (the abandoned run after a
        roll-back to it); the one before a dropped newest becomes the newest if still readable."""
    def bound_versions(self, newest: int) -> None:
        """Refuse, from now on, any version newer than `newest` from any source, committed
        here or not (the holder's step plus a window: the job's record, not the sender's)."""
    def held_bytes(self) -> int: ...
    def reserved_bytes(self) -> int: ...
    @property
    def budget_bytes(self) -> int: ...
    def info(self, source_rank: int) -> Dict[str, Any]: ...
    def stored_bytes(self, source_rank: int) -> bytes:
        """A copy of the committed replica's region."""
    def index_into(self, index: ProcessIndex, tag: int) -> None:
        """From now on, list the committed host versions held here in `index` as store `tag`."""
    def adopt_from_process(self, pid: int, region: int, meta: bytes) -> None:
        """Copy the version `meta` (encoded) describes from `region` in stopped process `pid`
        on this machine into this store as a committed version, every chunk checked against
        its CRC32C, reserving room for it when needed. ChecksumMismatchError: the bytes there
        are not that version's; PeerConnectionError: the process is gone; UnavailableError:
        not permitted to read it (ptrace rules), or a device replica store."""

class ProcessIndex:
    """Where this process's stores keep their committed versions, readable from another
    process on this machine while this one is stopped (csrc/store/process_index.h)."""

    def __init__(self) -> None: ...
    @property
    def address(self) -> int:
        """The index's address in this process: what a reader is given."""
    def entries(self) -> List[Tuple[int, int, int, int, int, bytes]]:
        """(store tag, source rank, version, region address, bytes, encoded metadata) per version."""

def read_process_index(pid: int, address: int) -> List[Tuple[int, int, int, int, int, bytes]]:
    """The entries of process `pid`'s ProcessIndex at `address` (as ProcessIndex.entries).
    UnavailableError: not permitted; PeerConnectionError: gone or unmapped; ProtocolError:
    no index there."""

class Credentials:
    """What a rank proves in the replication handshake: its private key, the job's
    certificate of (rank, its public key), and the job's public key (csrc/net/credentials.h).
    InvalidArgumentError unless the certificate certifies this key as this rank."""

    def __init__(self, rank: int, private_key: bytes, certificate: bytes, job_key: bytes) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def private_key(self) -> bytes: ...
    @property
    def certificate(self) -> bytes:
        """The job authority's Ed25519 signature (64 bytes)."""
    @property
    def public_key(self) -> bytes: ...
    @property
    def job_key(self) -> bytes: ...

class JobAuthority:
    """The job's issuer of credentials, derived from the job secret (>= 16 bytes):
    every holder of the secret (the agents) derives the same one."""

    def __init__(self, secret: bytes) -> None: ...
    @property
    def public_key(self) -> bytes: ...
    def certify(self, rank: int, private_key: bytes) -> bytes:
        """The certificate (64 bytes) of `rank` for the holder of `private_key` (32 bytes)."""
    def issue(self, rank: int) -> Credentials:
        """A fresh private key and its certificate for `rank`."""

class TcpServer:
    """Serves pushes into `replicas` and pulls from them or from this rank's own stores
    (`own_store` is store 0; `serve` adds more), after a handshake in which each end
    proves its rank's credentials (csrc/net/wire.h). Binds `host` (loopback by default). Hostile peers get their
    connection closed and a log line on stderr (see csrc/net/tcp_server.h)."""

    def __init__(
        self,
        replicas: ReplicaStore,
        own_store: Optional[SnapshotStore],
        *,
        credentials: Credentials,
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout_ms: int = 30000,
        protection: str = "authenticated",
        max_handshaking: int = 64,
        max_handshaking_per_source: int = 16,
        max_per_peer: int = 16,
        max_connections: int = 256,
    ) -> None:
        """protection: "authenticated" (an AES-256-GCM tag on every frame), "encrypted" or
        "trusted-fabric" (none), the same as every client's. The limits: connections in
        their handshake (in all, from one source address), per authenticated rank, in all.
        A newcomer over a handshake limit closes the oldest handshake of its source or of
        the busiest source; over the others it is closed at once (csrc/net/tcp_server.h)."""
    def serve(self, index: int, store: SnapshotStore) -> None:
        """Serve pulls of this rank's state kept in `store` as store `index` (>= 1, unused)."""
    def hold_parity(self, parity: ParityStore) -> None:
        """Fold the parity pieces other members push into `parity`, and serve the pieces it
        rebuilt; once per server."""
    @property
    def port(self) -> int: ...
    def stop(self) -> None: ...
    def stats(self) -> Dict[str, int]:
        """{accepted, rejected, refused, evicted, active} connections: refused ones were
        over a limit or found no thread to serve them; evicted ones were closed in their
        handshake to make room for a newer one."""

class Transport:
    """One transport interface (csrc/net/transport.h): blocking, GIL released."""

    @property
    def name(self) -> str: ...
    def abort(self) -> None:
        """Fail every pending and later call with AbortedError, promptly."""
    def describe(self, peer: int, source_rank: int, version: int, store: int = 0) -> Dict[str, Any]:
        """The metadata of (source_rank, version; -1 newest) held in the peer's store `store`."""
    def send_region(self, peer: int, meta: Dict[str, Any], region: int, source_rank: int = -1) -> None:
        """Send every chunk of the version `meta` describes, read from `region`."""
    def receive_region(self, peer: int, meta: Dict[str, Any], region: int, source_rank: int = -1) -> None:
        """Receive every chunk of that version into `region`, verified."""

class TcpTransport(Transport):
    def __init__(
        self,
        *,
        credentials: Credentials,
        connections_per_peer: int = 4,
        connect_timeout_ms: int = 5000,
        io_timeout_ms: int = 30000,
        protection: str = "authenticated",
    ) -> None: ...
    def add_peer(self, rank: int, host: str, port: int) -> None:
        """Where `rank` listens; a server there that proves another rank is refused."""

class Replicator:
    """Pushes committed versions of `store` to holders (background, one round in
    flight) and pulls a rank's state from several sources at once."""

    def __init__(self, store: SnapshotStore, transport: Transport, rank: int) -> None: ...
    def replicate(self, version: int, holders: List[int]) -> None: ...
    def push_pieces(self, version: int, members: List[int], index: int, own: Optional[ParityStore] = None,
                    wait_ms: int = 30000) -> None:
        """A round like replicate()'s to this rank's parity group (`members` in group order,
        this rank at `index`): each other member gets the piece it folds, and its outcome is
        ok once the version's block is complete there; with `own`, one more outcome (this
        rank's) once its own block of the version is complete (waited up to `wait_ms`)."""
    def rebuild_piece(self, parity: ParityStore, lost_rank: int, version: int) -> None:
        """At a holder: rebuild the lost member's piece of `version` from the block and the
        other survivors' own snapshots (pulled at once), verify it against the member's
        checksums and keep it in `parity` for the replacement. Blocks, without the GIL.
        ConnectionError naming the survivors that could not serve; ChecksumMismatchError when
        a survivor's snapshot of that version is not the one it pushed."""
    def pull_pieces(self, members: List[int], lost: int, version: int) -> int:
        """At the replacement of member index `lost`: pull `version` as g - 1 pieces from the
        holders that rebuilt them into the store, committed; returns the version."""
    def wait(self, version: int) -> List[Tuple[int, Optional[Error]]]: ...
    def in_flight_version(self) -> Optional[int]: ...
    def pull(self, sources: List[PullSource], version: int = -1,
             meta: Optional[bytes] = None) -> Tuple[int, int, int]:
        """Lands a committed version in the store, replacing the store's copy of that version
        and any newer one; returns (that version, its chunks, those read from same-machine
        memory). Sources with pid and region are read from that process's memory first; the
        transport carries whatever that could not provide (not permitted, process gone, bad
        checksum). `meta`: the version's encoded metadata, when the caller has it (a stopped
        holder's ProcessIndex): no source is asked for it."""

class PullSource:
    """A peer to pull from: whose state (`rank`) to ask it for, from which of its stores
    (0: a replica or its own state; 1 + s: its data-parallel share s), and, for a peer on
    this machine, its `pid` and the `region` address of the version there."""

    def __init__(self, peer: int, rank: int, *, store: int = 0, pid: int = 0, region: int = 0) -> None: ...
    peer: int
    rank: int
    store: int
    pid: int
    region: int

def nccl_load() -> Dict[str, Any]:
    """Find libnccl at run time: {version, version_code, origin}; UnavailableError says why not."""
def nccl_unique_id() -> bytes: ...
def nccl_transport(unique_id: bytes, nranks: int, rank: int, device: int, timeout_ms: int = 60000) -> Transport: ...

def parity_pieces(store: SnapshotStore, version: Optional[int], group_size: int) -> List[Tuple[int, int, int, int]]:
    """The g - 1 pieces a member cuts `version` (None: the next snapshot, as registered now)
    into: (first chunk, end chunk, region offset, nbytes) each, whole chunks
    (csrc/store/parity.h); piece t goes to member (i + 1 + t) mod g."""

class ParityStore:
    """The parity block a holder keeps for its group (csrc/store/parity_store.h): the other
    members' pieces folded by XOR as they arrive, each chunk verified first; a version's
    block is committed when every piece is in. Two blocks at most."""

    def __init__(self, *, budget_bytes: int = 0) -> None: ...
    def hold(self, members: List[int], index: int, block_bytes: int) -> None:
        """Hold the parity of `members` (3 or more, in group order) as member `index`,
        in blocks of `block_bytes`. BudgetExceededError when two blocks do not fit."""
    def committed(self) -> List[int]:
        """Versions whose block is complete and readable, newest first."""
    def drop_newer(self, version: int) -> None: ...
    def bound_versions(self, newest: int) -> None: ...
    @property
    def members(self) -> List[int]: ...
    @property
    def index(self) -> int:
        """This holder's place in `members`."""
    @property
    def block_bytes(self) -> int: ...
    def held_bytes(self) -> int: ...
    def reserved_bytes(self) -> int: ...
    @property
    def budget_bytes(self) -> int: ...
    def forget_rebuilt(self) -> None:
        """Free the pieces rebuilt here."""
    def interrupt_waits(self) -> None:
        """End every wait for a block to be complete (a round's own outcome), and those begun
        before resume_waits(), with AbortedError."""
    def resume_waits(self) -> None: ...
    def block(self, version: int = -1) -> Tuple[int, bytes]:
        """(version, a copy of its block): the newest committed, or `version`."""

class ParityCoder:
    """Folds blocks into parity by XOR on ``threads`` threads (csrc/store/parity.h).
    Of {parity, piece_1 .. piece_n} with parity their XOR, any one is the XOR of the
    others: the same call encodes and rebuilds."""

    def __init__(self, threads: int = 1) -> None: ...
    @property
    def threads(self) -> int: ...
    def xor_blocks(self, destination: Tuple[int, int], sources: List[Tuple[int, int]],
                   accumulate: bool = False) -> None:
        """destination (pointer, nbytes) = XOR of the sources ((pointer, nbytes) each; bytes
        past a source's end count as zeros), or ^= with ``accumulate``. Blocks, without the
        GIL; the caller keeps every buffer alive. InvalidArgumentError, writing nothing,
        for a source longer than the destination, a null pointer or an overlap."""

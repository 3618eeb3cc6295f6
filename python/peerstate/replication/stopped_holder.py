"""A stopped process on this machine as a holder: a hung worker's stores, read
from its memory before it is killed.

A worker's own SnapshotStore and its ReplicaStore record their committed
versions in a ``_C.ProcessIndex`` (tags below) whose address the worker
publishes in its progress file. When its agent finds it hung, it freezes it
(SIGSTOP) instead of killing it, and its replacement on the same node reads
the index and the versions it names with process_vm_readv: the replicas the
hung worker held for its buddies are adopted into the replacement's own
ReplicaStore (served from there like any replica), so is the data-parallel
share it snapshotted (into the replacement's store of that share, served from
there like a survivor's), and its own state is one more source of the
replacement's pull. Every chunk is checked against its
CRC32C, so what a process stopped mid-update left is refused, not used.
"""

from __future__ import annotations

import ctypes
import os
from typing import Dict, List, NamedTuple, Tuple

from peerstate import _C

OWN_STATE = 0  # ProcessIndex tag of a worker's own SnapshotStore
REPLICAS = 1   # of its ReplicaStore
SHARES = 2     # of its store of data-parallel share i (local index): SHARES + i


# prctl(2)'s PR_SET_PTRACER (include/uapi/linux/prctl.h): Yama's exception to ptrace_scope=1.
_PR_SET_PTRACER = 0x59616D61


def permit_reads_by_the_node() -> bool:
    """Let the other processes of this node's job read this one's memory: its
    replacement, if it hangs (``StoppedHolder``), and same-node pullers of its
    data-parallel share. With Yama's ``ptrace_scope=1`` (Ubuntu's default) a
    process may read only its descendants' memory, and workers are siblings;
    this names this process's parent (the node's fork server, or its agent when
    workers start their own interpreters) as the one whose descendants may
    read it: the node's workers and spares, not every process of the user
    (``PR_SET_PTRACER_ANY`` would). True when Yama took it; False where Yama is
    absent (the kernel's same-user rule already permits it) or refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(os.getppid()), 0, 0, 0) == 0


class IndexedVersion(NamedTuple):
    """One committed version in a stopped process: where it lies there, and its metadata."""

    version: int
    region: int
    nbytes: int
    meta: bytes


class StoppedHolder:
    """The versions process ``pid`` (stopped, on this machine) indexed at ``address``.
    Raises a peerstate error when the index cannot be read (the process is gone,
    reading it is not permitted, or the address holds no index)."""

    def __init__(self, pid: int, address: int) -> None:
        self.pid = pid
        self.own: Dict[int, IndexedVersion] = {}
        self.replicas: Dict[int, Dict[int, IndexedVersion]] = {}
        self.shares: Dict[int, Dict[int, IndexedVersion]] = {}  # local share index -> version -> entry
        for store, source, version, region, nbytes, meta in _C.read_process_index(pid, address):
            entry = IndexedVersion(version, region, nbytes, meta)
            if store == OWN_STATE:
                self.own[version] = entry
            elif store == REPLICAS:
                self.replicas.setdefault(source, {})[version] = entry
            elif store >= SHARES:
                self.shares.setdefault(store - SHARES, {})[version] = entry

    def adopt_replicas(self, replicas: "_C.ReplicaStore") -> Tuple[Dict[int, List[int]], List[str]]:
        """Copy every replica held here into ``replicas``, oldest version of each source
        first (a store takes only newer versions). Returns (source -> versions adopted,
        why each one that was not)."""
        adopted: Dict[int, List[int]] = {}
        refused: List[str] = []
        for source, versions in sorted(self.replicas.items()):
            for version in sorted(versions):
                entry = versions[version]
                try:
                    replicas.adopt_from_process(self.pid, entry.region, entry.meta)
                    adopted.setdefault(source, []).append(version)
                except Exception as error:  # noqa: BLE001 - said, and that version is not claimed
                    refused.append(f"version {version} of rank {source}: {error}")
        return adopted, refused

    def own_source(self, version: int) -> Tuple[int, int, bytes]:
        """(pid, region, metadata) of its own ``version``, for a pull (KeyError if not held)."""
        entry = self.own[version]
        return self.pid, entry.region, entry.meta

    def share_source(self, share: int, version: int) -> Tuple[int, int, bytes]:
        """The same for ``version`` of the data-parallel share it kept in store ``share``."""
        entry = self.shares[share][version]
        return self.pid, entry.region, entry.meta

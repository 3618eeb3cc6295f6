"""The process-group rendezvous store a node's workers share: what torch reads
through it comes from the job's store once per node, and the node's other
workers get it from their node channel.

Why: forming an epoch's NCCL communicator has every rank read ids from the job's
store, and above ``TORCH_NCCL_RANKS_PER_ROOT`` (128) ranks, every root's id
(torch's scalable init: N/128 roots, N^2/128 ids in all; 268 MB of ids at 16,384
ranks). A node's ranks read the same ids, so reading them once per node takes 8x
fewer requests and bytes from the one store every node shares, and leaves the
rest on each node's loopback. gloo's addresses are read the same way.

The contract of the store ``node_rendezvous_store`` returns (a
``torch.distributed.Store``; torch calls it from C++ through its Python-store
trampoline, holding the GIL only while a call runs):
- Writes (``set``, ``multi_set``, ``add``, ``compare_set``, ``append``,
  ``delete_key``) and ``check``/``num_keys`` go to the job's store, as they would.
- Reads (``get``, ``multi_get``, ``wait``) block until the keys exist, TCPStore's
  semantics, and are read through the node: the first of the node's workers to
  ask for a set of keys claims them in the channel (``compare_set``), waits for
  them in the job's store and puts them in the channel; the others wait for them
  there. A claimant that fails (a timeout, an abort) gives its claim back, and a
  worker still waiting takes it over, so a read never depends on a worker that
  stopped reading. Without a channel every call reads for itself: torch's default.
- What this relies on: a key torch reads in a rendezvous is written once (unique
  ids, gloo's addresses, a barrier's last-worker flag, each under the epoch's
  prefix, ``keys.process_group_prefix``). Counters are read with ``add(key, 0)``,
  which goes to the job's store.
- A read that times out raises ``torch.distributed.DistStoreError``, as torch's
  stores do. ``interrupt()`` makes blocked and later reads fail at once (an
  abort of a rendezvous in progress); so does shutting down the sockets of the
  two connections, which the caller opens and owns (``ProcessGroups.form``).
- ``forget()`` removes from the channel what this worker put there for the node,
  once the epoch's groups are gone (``ProcessGroups.destroy``): a long job's
  recoveries do not pile up in its agents' channels.
- ``count``: the requests and bytes this store sent to the job's store (not the
  channel's): what ``bench/scale.py`` reports as the rendezvous's.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import os
import struct
import time
from typing import List, Optional, Sequence

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore, RequestCount, as_bytes

# How long a worker waits for the node's claimant before it looks whether the claim was given
# back (a claimant that failed): a bound on how late a take-over starts, not on the read.
TAKE_OVER_SECONDS = 1.0

_TYPE = None


def node_rendezvous_store(store, channel: Optional[KeyValueStore], timeout: float):
    """A torch Store over ``store`` (a torch Store on the job's store: a
    ``KeyValueStore.rendezvous_store()``, which this store then owns) whose reads are
    shared through ``channel`` (the node channel, a connection of its own, or None:
    every read is this worker's own). ``timeout``: a read's wait, until torch sets
    another (``set_timeout``)."""
    global _TYPE
    if _TYPE is None:
        _TYPE = _define()
    return _TYPE(store, channel, timeout)


def _define():
    import torch.distributed as dist

    class NodeRendezvousStore(dist.Store):
        def __init__(self, store, channel: Optional[KeyValueStore], timeout: float) -> None:
            super().__init__()
            self.store, self.channel = store, channel
            self.wait_timeout = timeout
            self.count = RequestCount()
            self._clones: List = []
            self._written: List[str] = []  # what it put in the channel, for forget()
            self._token = f"{os.getpid()}:{id(self)}".encode()
            store.set_timeout(datetime.timedelta(seconds=timeout))

        # -- writes and checks: the job's store --------------------------------------------
        def set(self, key: str, value) -> None:
            value = as_bytes(value)
            self.count.sent(1, key, value)
            self.store.set(key, value)

        def multi_set(self, names: List[str], values) -> None:
            values = [as_bytes(v) for v in values]
            self.count.sent(1, *names, *values)
            self.store.multi_set(names, values)

        def add(self, key: str, amount: int) -> int:
            self.count.sent(1, key)
            return self.store.add(key, amount)

        def compare_set(self, key: str, expected, desired) -> bytes:
            self.count.sent(1, key, as_bytes(expected), as_bytes(desired))
            return self.store.compare_set(key, expected, desired)

        def append(self, key: str, value) -> None:
            self.count.sent(1, key, as_bytes(value))
            self.store.append(key, value)

        def check(self, names: List[str]) -> bool:
            self.count.sent(1, *names)
            return self.store.check(names)

        def delete_key(self, key: str) -> bool:
            self.count.sent(1, key)
            return self.store.delete_key(key)

        def num_keys(self) -> int:
            self.count.sent(1)
            return self.store.num_keys()

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self.wait_timeout = timeout.total_seconds()
            self.store.set_timeout(timeout)

        def clone(self):
            """Connections of its own to both stores (torch's ``shrink_group`` asks for one); one count."""
            twin = node_rendezvous_store(self.store.clone(), self.channel.clone() if self.channel else None,
                                         self.wait_timeout)
            twin.count = self.count
            self._clones.append(twin)  # torch holds it by its C++ half only: see ProcessGroups._store
            return twin

        def forget(self) -> None:
            """Remove from the channel what this store and its clones put there: call it once
            the epoch's groups are gone (its members read it while they formed them, and
            a newer epoch reads keys of its own)."""
            for store in (self, *self._clones):
                if store._written:
                    store.channel.delete_many(store._written)
                    store._written = []

        def interrupt(self) -> None:
            for part in (self.store, self.channel):
                if hasattr(part, "interrupt"):
                    part.interrupt()

        # -- reads: once per node --------------------------------------------------------
        def get(self, key: str) -> bytes:
            return self._read([key], None)[0]

        def multi_get(self, names: List[str]) -> List[bytes]:
            return self._read(list(names), None)

        def wait(self, names: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
            self._read(list(names), timeout)

        def _read(self, names: List[str], timeout: Optional[datetime.timedelta]) -> List[bytes]:
            seconds = self.wait_timeout if timeout is None else timeout.total_seconds()
            if self.channel is None:
                return self._fetch(names, timeout)
            digest = names[0] if len(names) == 1 else hashlib.sha256("\n".join(names).encode()).hexdigest()
            held, claim = keys.rendezvous_read(digest), keys.rendezvous_claim(digest)
            deadline = time.monotonic() + seconds
            while True:
                packed = self.channel.get(held)
                if packed is not None:
                    return _unpack(packed)
                if self.channel.compare_set(claim, b"", self._token) == self._token:
                    return self._fetch_for_node(names, timeout, held, claim)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(f"wait for {names[:4]} timed out after {seconds:.1f}s "
                                              f"(another worker of this node was reading them)")
                try:
                    self.channel.wait([held], min(TAKE_OVER_SECONDS, left))
                except TimeoutError:
                    pass  # then: read by now, or the claim given back?

        def _fetch_for_node(self, names: List[str], timeout, held: str, claim: str) -> List[bytes]:
            self._written.append(claim)
            try:
                values = self._fetch(names, timeout)
            except BaseException:
                try:
                    self.channel.compare_set(claim, self._token, b"")  # another worker of the node takes over
                except Exception:  # noqa: BLE001 - an aborted rendezvous shut the channel's socket too
                    pass
                raise
            self.channel.set(held, _pack(values))
            self._written.append(held)
            return values

        def _fetch(self, names: List[str], timeout: Optional[datetime.timedelta]) -> List[bytes]:
            """The keys from the job's store: TCPStore's multi_get is a wait and a read;
            a wait with a timeout of its own is one more request."""
            if timeout is not None:
                self.count.sent(1, *names)
                self.store.wait(names, timeout)
            self.count.sent(2, *names, *names)
            values = [bytes(v) for v in self.store.multi_get(names)]
            self.count.received(values)
            return values

    return NodeRendezvousStore


def _pack(values: Sequence[bytes]) -> bytes:
    """The values as one: their count, their lengths, then the values themselves (what
    every other member of the node unpacks, so one call each, not one per value)."""
    return struct.pack(f"<I{len(values)}I", len(values), *map(len, values)) + b"".join(values)


def _unpack(packed: bytes) -> List[bytes]:
    (count,) = struct.unpack_from("<I", packed)
    ends = list(itertools.accumulate(struct.unpack_from(f"<{count}I", packed, 4), initial=4 + 4 * count))
    return [packed[a:b] for a, b in zip(ends, ends[1:])]

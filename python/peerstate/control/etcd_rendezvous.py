"""A ``torch.distributed.Store`` over an EtcdKeyValueStore, for the one thing that
needs torch's own store type: ``init_process_group`` and ``new_group`` (gloo and
NCCL exchange their addresses through it). torch calls it from C++ through its
Python-store trampoline; each call holds the GIL only while it runs.

Semantics are TCPStore's: ``get`` waits for the key (up to the store's timeout),
``add`` creates a counter at 0, ``wait`` raises on timeout. ``interrupt()``
makes a blocked and every later ``wait``/``get`` fail at once: what an abort of
a rendezvous in progress does (``ProcessGroups.abort``).
"""

from __future__ import annotations

import datetime
from typing import List, Optional

from peerstate.control.kvstore import as_bytes

_TYPE = None


def rendezvous_store(kv, timeout: float = 300.0):
    """A new torch Store over ``kv`` (an EtcdKeyValueStore that this store then owns)."""
    global _TYPE
    if _TYPE is None:
        _TYPE = _define()
    return _TYPE(kv, timeout)


def _define():
    import torch.distributed as dist

    class EtcdRendezvousStore(dist.Store):
        def __init__(self, kv, timeout: float) -> None:
            super().__init__()
            self.kv = kv
            self.wait_timeout = timeout
            self._clones: List = []

        def clone(self):
            """A connection of its own (torch's ``shrink_group`` clones its group's store)."""
            twin = _TYPE(self.kv.clone(), self.wait_timeout)
            self._clones.append(twin)  # torch holds it by its C++ half only, which needs the Python object
            return twin

        def set(self, key: str, value) -> None:
            self.kv.set(key, as_bytes(value))

        def get(self, key: str) -> bytes:
            try:
                return self.kv.wait_get(key, self.wait_timeout)
            except TimeoutError:
                raise dist.DistStoreError(f"get of {key!r} timed out after {self.wait_timeout:.1f}s") from None

        def add(self, key: str, amount: int) -> int:
            return self.kv.add(key, amount)

        def compare_set(self, key: str, expected, desired) -> bytes:
            return self.kv.compare_set(key, as_bytes(expected), as_bytes(desired))

        def append(self, key: str, value) -> None:
            self.kv.append(key, as_bytes(value))

        def multi_get(self, keys: List[str]) -> List[bytes]:
            self._wait(keys, None)
            return self.kv.get_existing(keys)

        def multi_set(self, keys: List[str], values) -> None:
            self.kv.set_many([(k, as_bytes(v)) for k, v in zip(keys, values)])

        def check(self, keys: List[str]) -> bool:
            return all(v is not None for v in self.kv.get_many(keys))

        def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
            self._wait(keys, timeout)

        def delete_key(self, key: str) -> bool:
            return self.kv.delete(key)

        def num_keys(self) -> int:
            return self.kv.count_keys()

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self.wait_timeout = timeout.total_seconds()

        def interrupt(self) -> None:
            self.kv.interrupt()

        def _wait(self, keys: List[str], timeout: Optional[datetime.timedelta]) -> None:
            seconds = self.wait_timeout if timeout is None else timeout.total_seconds()
            try:
                self.kv.wait(keys, seconds)
            except TimeoutError:
                # torch's own stores raise DistStoreError on a timeout; its callers catch that.
                raise dist.DistStoreError(f"wait for {keys} timed out after {seconds:.1f}s") from None

    return EtcdRendezvousStore

"""InMemoryKeyValueStore: the KeyValueStore contract kept in this process's
memory, for the unit tests of the control plane's logic (and any single-process
use). Every call is atomic under one lock, as the contract requires."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

from peerstate.control.kvstore import KeyValueStore


class _Shared:
    """What a store and its clones share: the data, its lock, and the waits blocked on it."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.waits: List[Tuple[Set[str], threading.Event]] = []  # (keys still missing, set when none is)


class InMemoryKeyValueStore(KeyValueStore):
    """A second implementation of ``KeyValueStore``; clones share the data.

    A wait is woken by a write of one of its own keys only, as a TCPStore's is: a
    node channel that woke every waiter at every write (each node's relay, marks
    forwarder and members wait on one) cost ``bench/scale.py`` a CPU-second and a
    half of wake-ups at 2,048 simulated nodes, which a real node channel never pays."""

    def __init__(self, _shared: Optional[_Shared] = None) -> None:
        self._shared = _shared or _Shared()
        self._data = self._shared.data
        self._lock = self._shared.lock
        self._interrupted = False  # this connection's, not its clones'
        self._mine: List[Tuple[Set[str], threading.Event]] = []  # this connection's blocked waits

    def _written(self, keys) -> None:
        """Wake the waits that ``keys`` completed (under the lock)."""
        for missing, done in self._shared.waits:
            missing.difference_update(keys)
            if not missing:
                done.set()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(value)
            self._written((key,))

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            return self._data.get(key)

    def get_many(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        with self._lock:
            return [self._data.get(k) for k in keys]

    def set_many(self, items: Sequence[Tuple[str, bytes]]) -> None:
        with self._lock:
            self._data.update((k, bytes(v)) for k, v in items)
            self._written([k for k, _ in items])

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._written((key,))
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._lock:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = bytes(desired)
                self._written((key,))
            return self._data.get(key, b"")

    def append(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = self._data.get(key, b"") + bytes(value)
            self._written((key,))

    def delete_many(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._data.pop(key, None)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        with self._lock:
            missing = {k for k in keys if k not in self._data}
            if not missing:
                return
            if self._interrupted:
                raise ConnectionAbortedError(f"the wait for keys {list(keys)} was interrupted")
            waiting = (missing, threading.Event())
            self._shared.waits.append(waiting)
            self._mine.append(waiting)
        try:
            waiting[1].wait(max(timeout, 0.0))
        finally:
            with self._lock:
                self._shared.waits.remove(waiting)
                self._mine.remove(waiting)
        if missing:
            if self._interrupted:
                raise ConnectionAbortedError(f"the wait for keys {list(keys)} was interrupted")
            raise TimeoutError(f"keys {list(keys)} did not appear within {timeout:.1f}s")

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            for _, done in self._mine:
                done.set()

    def clone(self) -> "InMemoryKeyValueStore":
        return InMemoryKeyValueStore(self._shared)

    def keys(self) -> List[str]:
        """Every key held (for tests that check what was written)."""
        with self._lock:
            return sorted(self._data)

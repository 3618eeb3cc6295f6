"""InMemoryKeyValueStore: the KeyValueStore contract kept in this process's
memory, for the unit tests of the control plane's logic (and any single-process
use). Every call is atomic under one lock, as the contract requires."""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from peerstate.control.kvstore import KeyValueStore


class InMemoryKeyValueStore(KeyValueStore):
    """A second implementation of ``KeyValueStore``; clones share the data."""

    def __init__(self, _shared: Optional[tuple] = None) -> None:
        self._data: Dict[str, bytes]
        self._changed: threading.Condition
        self._data, self._changed = _shared or ({}, threading.Condition())
        self._interrupted = False  # this connection's, not its clones'

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = bytes(value)
            self._changed.notify_all()

    def get(self, key: str) -> Optional[bytes]:
        with self._changed:
            return self._data.get(key)

    def get_many(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        with self._changed:
            return [self._data.get(k) for k in keys]

    def set_many(self, items: Sequence[Tuple[str, bytes]]) -> None:
        with self._changed:
            self._data.update((k, bytes(v)) for k, v in items)
            self._changed.notify_all()

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = bytes(desired)
                self._changed.notify_all()
            return self._data.get(key, b"")

    def append(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = self._data.get(key, b"") + bytes(value)
            self._changed.notify_all()

    def delete_many(self, keys: Sequence[str]) -> None:
        with self._changed:
            for key in keys:
                self._data.pop(key, None)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(k in self._data for k in keys):
                if self._interrupted:
                    raise ConnectionAbortedError(f"the wait for keys {list(keys)} was interrupted")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"keys {list(keys)} did not appear within {timeout:.1f}s")
                self._changed.wait(left)

    def interrupt(self) -> None:
        with self._changed:
            self._interrupted = True
            self._changed.notify_all()

    def clone(self) -> "InMemoryKeyValueStore":
        return InMemoryKeyValueStore((self._data, self._changed))

    def keys(self) -> List[str]:
        """Every key held (for tests that check what was written)."""
        with self._changed:
            return sorted(self._data)

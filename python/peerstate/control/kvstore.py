"""The key-value store the control plane keeps its state in.

``KeyValueStore`` is the small interface the coordinator, the agents and the
workers need; ``TorchKeyValueStore`` implements it over
``torch.distributed.TCPStore`` (the embedded default: the launcher of node 0
hosts it, no extra server). Another store (etcd at larger scale) plugs in by
implementing the same seven methods.

Values are ``bytes``; callers encode JSON. Every blocking call takes a
timeout in seconds and raises ``TimeoutError`` when it passes.
"""

from __future__ import annotations

import datetime
from typing import List, Optional, Sequence


class KeyValueStore:
    """The contract. Implementations must make ``add`` and ``compare_set`` atomic
    across all clients: the coordinator's one-plan-per-epoch rule rests on them."""

    def set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> Optional[bytes]:
        """The value, or None when the key does not exist (never blocks)."""
        raise NotImplementedError

    def get_many(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        return [self.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        """Atomically add to an integer counter (created at 0); returns the new value."""
        raise NotImplementedError

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Atomically set ``key`` to ``desired`` if it holds ``expected`` (b"" = absent);
        returns the value the key holds afterwards."""
        raise NotImplementedError

    def append(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Block until every key exists; TimeoutError after ``timeout`` seconds."""
        raise NotImplementedError

    def clone(self) -> "KeyValueStore":
        """Another connection to the same store (for a thread that blocks in wait())."""
        raise NotImplementedError


class TorchKeyValueStore(KeyValueStore):
    """Over ``torch.distributed.TCPStore``. ``host_store=True`` makes this process the
    server (``port`` 0 picks a free one; see ``.port``)."""

    def __init__(self, host: str, port: int, *, host_store: bool = False, timeout: float = 60.0,
                 _store=None) -> None:
        import torch.distributed as dist

        self.host = host
        if _store is not None:
            self.torch_store = _store
        else:
            self.torch_store = dist.TCPStore(host, port, None, host_store, timeout=datetime.timedelta(seconds=timeout),
                                             wait_for_workers=False, use_libuv=True)
        self.port = self.torch_store.port

    def set(self, key: str, value: bytes) -> None:
        self.torch_store.set(key, value)

    def get(self, key: str) -> Optional[bytes]:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        # check() then multi_get(): TCPStore.get() would block on a missing key. When
        # every key exists (after a wait() on them, say) that is two requests in all;
        # otherwise one check per key finds the missing ones.
        keys = list(keys)
        if not keys:
            return []
        if self.torch_store.check(keys):
            return list(self.torch_store.multi_get(keys))
        present = [k for k in keys if self.torch_store.check([k])]
        values = dict(zip(present, self.torch_store.multi_get(present))) if present else {}
        return [values.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        return self.torch_store.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.torch_store.compare_set(key, expected, desired)

    def append(self, key: str, value: bytes) -> None:
        self.torch_store.append(key, value)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        try:
            self.torch_store.wait(list(keys), datetime.timedelta(seconds=max(timeout, 0.001)))
        except Exception as error:  # DistStoreError on timeout; anything else is a lost store
            if "timeout" in str(error).lower():
                raise TimeoutError(f"keys {list(keys)} did not appear within {timeout:.1f}s") from None
            raise

    def clone(self) -> "TorchKeyValueStore":
        return TorchKeyValueStore(self.host, self.port, _store=self.torch_store.clone())

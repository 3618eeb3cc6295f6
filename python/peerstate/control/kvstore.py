"""The key-value store the control plane keeps its state in.

``KeyValueStore`` is the small interface the coordinator, the agents and the
workers need; ``TorchKeyValueStore`` implements it over
``torch.distributed.TCPStore`` (the embedded default: the launcher of node 0
hosts it, no extra server); ``EtcdKeyValueStore`` (``etcd_store``) implements it
over a replicated etcd cluster, so that no node's loss takes the store with it.
``open_store`` opens either from its address.

Values are ``bytes``; callers encode JSON. Every blocking call takes a
timeout in seconds and raises ``TimeoutError`` when it passes. A store that
cannot be reached at all raises ``StoreUnavailableError`` (etcd, past its bound)
or torch's ``DistNetworkError`` (TCPStore).
"""

from __future__ import annotations

import datetime
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Set, Tuple

from peerstate.control.sockets import connection_at, lowest_free_descriptor, shutdown
from peerstate.errors import StoreUnavailableError


def store_gone(error: BaseException) -> bool:
    """Whether ``error`` says the store cannot be reached (etcd past its bound, a TCPStore's
    socket closed) rather than something wrong in the caller."""
    if isinstance(error, (StoreUnavailableError, ConnectionError)):
        return True
    dist = sys.modules.get("torch.distributed")  # loaded by whoever holds a TCPStore
    return dist is not None and isinstance(error, dist.DistError)


# No wait shorter: a TCPStore wait of 1-10 ms that times out takes 5 s to do so in
# about 3% of calls (torch 2.13, measured: the cancel races the server's answer).
_SHORTEST_WAIT = 0.05


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

    def set_many(self, items: Sequence[Tuple[str, bytes]]) -> None:
        """Set several keys (one request where the store allows it)."""
        for key, value in items:
            self.set(key, value)

    def get_existing(self, keys: Sequence[str]) -> List[bytes]:
        """The values of keys known to exist (a wait() on them returned): one request
        where the store allows it. A key that does not exist blocks, up to the
        store's own timeout, or raises."""
        values = self.get_many(keys)
        if any(v is None for v in values):
            raise KeyError(f"get_existing: {[k for k, v in zip(keys, values) if v is None]} do not exist")
        return values  # type: ignore[return-value]

    def wait_get(self, key: str, timeout: float) -> bytes:
        """Block until ``key`` exists and return its value (fewer round trips than
        wait() then get() where the store allows it); TimeoutError after ``timeout``."""
        self.wait([key], timeout)
        return self.get_existing([key])[0]

    def add(self, key: str, amount: int) -> int:
        """Atomically add to an integer counter (created at 0); returns the new value."""
        raise NotImplementedError

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Atomically set ``key`` to ``desired`` if it holds ``expected`` (b"" = absent);
        returns the value the key holds afterwards."""
        raise NotImplementedError

    def append(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the keys (one that does not exist is no error)."""
        raise NotImplementedError

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Block until every key exists; TimeoutError after ``timeout`` seconds."""
        raise NotImplementedError

    def wait_until(self, keys: Sequence[str], deadline: float, moot: Callable[[], bool] = lambda: False,
                   poll: float = 0.25) -> bool:
        """Block until every key exists (True), or until ``moot()`` says the wait no
        longer matters (False): a newer epoch began, the job stopped. ``moot`` is asked
        after each ``poll`` seconds without the keys, on the caller's thread, and may
        raise to end the wait with its own error. ``deadline`` is a ``time.monotonic()``
        instant; TimeoutError once it passes with a key still missing. The one wait
        loop of the control plane: callers say what makes their wait moot, not how
        to poll."""
        while True:
            try:
                self.wait(keys, timeout=max(min(poll, deadline - time.monotonic()), _SHORTEST_WAIT))
                return True
            except TimeoutError:
                if moot():
                    return False
                if time.monotonic() >= deadline:
                    raise

    def clone(self) -> "KeyValueStore":
        """Another connection to the same store (for a thread that blocks in wait())."""
        raise NotImplementedError

    def interrupt(self) -> None:
        """Make a wait() of this connection blocked in another thread, and every later
        one, fail now with an error ``store_gone`` recognises (thread-safe). The
        connection is done: what its other requests do after it is not defined. A
        connection that cannot be interrupted (a TCPStore's first, not a clone) does
        nothing: its wait ends at its timeout."""

    def rendezvous_store(self):
        """A ``torch.distributed.Store`` over the same keys, on its own connection, for
        ``init_process_group`` (the caller owns it). Its ``interrupt()``, where it has one,
        fails a blocked wait at once; a TCPStore clone is interrupted by shutting its socket."""
        raise NotImplementedError

    def describe(self) -> str:
        """The store, in words, for messages."""
        return type(self).__name__


@dataclass
class RequestCount:
    """Requests a client sent to its store, and the bytes of keys and values that
    went each way (what ``bench/scale.py`` reports, and each worker's recovery
    report; clones count into the same one, a ``rendezvous_store()`` does not)."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def sent(self, requests: int, *payloads: object) -> None:
        self.requests += requests
        self.bytes_sent += sum(map(len, payloads))  # type: ignore[arg-type]

    def received(self, values: Sequence[bytes]) -> None:
        self.bytes_received += sum(map(len, values))


def as_bytes(value) -> bytes:
    """A value torch hands a Python store (``str`` or bytes-like) as bytes."""
    return value.encode() if isinstance(value, str) else bytes(value)


# What TorchKeyValueStore._read() compares a key with: no value the control plane writes is this.
_ABSENT = b"\x00peerstate: no such key\x00"


class TorchKeyValueStore(KeyValueStore):
    """Over ``torch.distributed.TCPStore``. ``host_store=True`` makes this process the
    server, listening on ``host`` only (``port`` 0 picks a free one; see ``.port``):
    TCPStore alone would listen on every interface."""

    def __init__(self, host: str, port: int, *, host_store: bool = False, timeout: float = 60.0,
                 _store=None, _count: Optional[RequestCount] = None, _sockets: Set[str] = frozenset()) -> None:
        import torch.distributed as dist

        self.host = host
        self.count = _count or RequestCount()
        self._sockets = _sockets  # a clone's connection (interrupt)
        self._listener: Optional[socket.socket] = None
        if _store is not None:
            self.torch_store = _store
        else:
            options = dict(timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False, use_libuv=True)
            if host_store:
                self._listener = socket.create_server((host, port), family=_family(host), backlog=4096)
                port = self._listener.getsockname()[1]
                options["master_listen_fd"] = self._listener.fileno()
            self.torch_store = dist.TCPStore(host, port, None, host_store, **options)
        self.port = self.torch_store.port

    def set(self, key: str, value: bytes) -> None:
        self.count.sent(1, key, value)
        self.torch_store.set(key, value)

    def set_many(self, items: Sequence[Tuple[str, bytes]]) -> None:
        if items:
            self.count.sent(1, *(k for k, _ in items), *(v for _, v in items))
            self.torch_store.multi_set([k for k, _ in items], [v for _, v in items])

    def get(self, key: str) -> Optional[bytes]:
        # check() first: TCPStore.get() would wait for a missing key. Then the value in one
        # round trip (see _read), where TCPStore.get() takes two (a wait and a get).
        self.count.sent(1, key)
        if not self.torch_store.check([key]):
            return None
        return self._read(key)

    def _read(self, key: str) -> Optional[bytes]:
        """An existing key's value in one round trip: a compare_set whose expected value no
        key holds changes nothing and answers the value. Only for a key known to exist: for
        a missing one TCPStore answers the expected value, and its libuv server also wakes
        every client waiting for that key, who would take it as set. None if it is missing."""
        self.count.sent(1, key)
        value = self.torch_store.compare_set(key, _ABSENT, b"")
        if value == _ABSENT:
            return None
        self.count.received([value])
        return value

    def get_many(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        # check() then multi_get(). When every key exists (after a wait() on them, say)
        # that is two requests in all; otherwise one check per key finds the missing ones.
        keys = list(keys)
        if not keys:
            return []
        self.count.sent(1, *keys)
        if self.torch_store.check(keys):
            self.count.sent(1, *keys)
            values = list(self.torch_store.multi_get(keys))
            self.count.received(values)
            return values
        self.count.sent(len(keys), *keys)
        present = [k for k in keys if self.torch_store.check([k])]
        if present:
            self.count.sent(1, *present)
        values = dict(zip(present, self.torch_store.multi_get(present))) if present else {}
        self.count.received(list(values.values()))
        return [values.get(k) for k in keys]

    def get_existing(self, keys: Sequence[str]) -> List[bytes]:
        keys = list(keys)
        if len(keys) == 1:  # one round trip (_read); multi_get is a wait and a get
            value = self._read(keys[0])
            if value is not None:
                return [value]
        self.count.sent(1, *keys)
        values = list(self.torch_store.multi_get(keys))
        self.count.received(values)
        return values

    def add(self, key: str, amount: int) -> int:
        self.count.sent(1, key)
        return self.torch_store.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self.count.sent(1, key, expected, desired)
        value = self.torch_store.compare_set(key, expected, desired)
        self.count.received([value])
        return value

    def append(self, key: str, value: bytes) -> None:
        self.count.sent(1, key, value)
        self.torch_store.append(key, value)

    def delete_many(self, keys: Sequence[str]) -> None:
        self.count.sent(len(keys), *keys)  # TCPStore deletes one key a request
        for key in keys:
            self.torch_store.delete_key(key)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self.count.sent(1, *keys)
        try:
            self.torch_store.wait(list(keys), datetime.timedelta(seconds=max(timeout, 0.001)))
        except Exception as error:  # DistStoreError on timeout; anything else is a lost store
            if "timeout" in str(error).lower():
                raise TimeoutError(f"keys {list(keys)} did not appear within {timeout:.1f}s") from None
            raise

    def clone(self) -> "TorchKeyValueStore":
        descriptor = lowest_free_descriptor()  # the new connection's, unless another thread takes it
        store = self.torch_store.clone()
        return TorchKeyValueStore(self.host, self.port, _store=store, _count=self.count,
                                  _sockets=connection_at(descriptor, self.port))

    def interrupt(self) -> None:
        # A clone's connection is shut: the socket at the descriptor that was free when
        # clone() connected, if it is connected to this store (another thread's clone()
        # at that moment may have taken it: that one is shut then, and this wait ends at
        # its timeout). Not the first connection's: its wait ends at its timeout.
        shutdown(self._sockets)

    def rendezvous_store(self):
        return self.torch_store.clone()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def describe(self) -> str:
        return f"the TCPStore at {self.address}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET

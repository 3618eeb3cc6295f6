"""EtcdKeyValueStore: the KeyValueStore contract over etcd v3, a replicated store,
so that the job's control plane outlives any node (``--store etcd://...``).

It speaks etcd's v3 JSON gateway (``POST /v3/kv/range``, ``/v3/kv/txn``,
``/v3/watch`` on the client port, in etcd 3.4 and later) with the standard
library's ``http.client``. Why not a client library: the maintained gRPC client
(python-etcd3) has had no release since 2020 and needs an old protobuf; the
gateway client (etcd3gw) talks to one endpoint and runs a thread per watch.
peerstate needs five gateway calls, failover between endpoints, and a watch
whose socket an abort can shut; that is less code than wrapping either.

How the contract maps onto etcd:

- every key lives under the job's prefix (``/peerstate/<job id>/``);
- ``compare_set`` is one transaction (compare the value, or ``create_revision
  == 0`` for absent); ``add`` and ``append`` are compare-on-``mod_revision``
  transactions retried until they win, so both are atomic across clients;
- ``get_many``/``set_many`` are one transaction per 128 keys (etcd's default
  ``--max-txn-ops``); reads are linearizable (etcd's default);
- ``wait`` reads the keys and watches the missing ones (one watch over their
  range) from the revision of that read: no polling, and no create can slip
  between the read and the watch.

TLS: ``etcds://`` speaks HTTPS, verifying the members against ``cacert`` (the
system's CAs without one) and presenting ``cert``/``key`` where the cluster asks
for client certificates (Kubernetes' etcd does). A handshake that fails on a
certificate is a configuration error, raised at once (InvalidArgumentError), not
an unavailable store.

Failures of the store itself. A request that cannot reach a member, or that a
member answers "unavailable" (no leader during an election), is sent to the
next endpoint, backing off to 0.5 s after each round of all of them. Past
``unavailable_timeout`` seconds without an answer the call raises
``StoreUnavailableError``, which names the endpoints and the bound: the agent
then stops its workers (see docs/operations.md). A write whose
answer was lost with its member is sent again: harmless for ``set`` and
``compare_set``; an ``add`` may then count twice (the lease counters only move
faster; the job's tallies compare with ``>=``).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import parse_qs, quote, urlsplit

from peerstate.control.kvstore import KeyValueStore, RequestCount
from peerstate.errors import InvalidArgumentError, StoreUnavailableError

SCHEME = "etcd://"
TLS_SCHEME = "etcds://"
MAX_TXN_OPS = 128          # etcd's default --max-txn-ops
DEFAULT_UNAVAILABLE_TIMEOUT = 20.0
_ABSENT = {"target": "CREATE", "create_revision": "0"}  # a compare: the key does not exist
_UNAVAILABLE_CODES = {4, 14}  # gRPC DEADLINE_EXCEEDED ("request timed out"), UNAVAILABLE ("no leader")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class _Retry(Exception):
    """This member cannot answer now; try the next."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of an ``etcds://`` client: the CA that signed the members (None: the
    system's), and this client's certificate and key (None: no client certificate)."""

    cacert: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.cacert)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context

    def query(self) -> str:
        return "".join(f"&{name}={quote(path)}" for name, path in asdict(self).items() if path)


class EtcdKeyValueStore(KeyValueStore):
    """One client of an etcd cluster; ``endpoints`` are the members' client ``HOST:PORT``.

    Threads may share it: their calls take turns on one connection, and a wait
    watches on a connection of its own (``clone()`` for a thread that must not
    queue behind another's calls). Any call may block up to ``unavailable_timeout``
    while no member answers, then raises StoreUnavailableError; ``interrupt()``
    may be called from any thread."""

    def __init__(self, endpoints: Sequence[str], prefix: str, *,
                 unavailable_timeout: float = DEFAULT_UNAVAILABLE_TIMEOUT, tls: Optional[TlsFiles] = None,
                 _count: Optional[RequestCount] = None) -> None:
        if not endpoints:
            raise InvalidArgumentError("an etcd store needs at least one HOST:PORT endpoint")
        self.endpoints = [_endpoint(e) for e in endpoints]
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.unavailable_timeout = unavailable_timeout
        self.tls = tls
        try:
            self._tls_context = tls.context() if tls else None
        except (OSError, ssl.SSLError) as error:
            raise InvalidArgumentError(f"the etcd TLS files {tls} cannot be used: {error} (check --store-cacert, "
                                       "--store-cert and --store-key)") from None
        self.count = _count or RequestCount()
        self._current = 0
        self._connection: Optional[http.client.HTTPConnection] = None
        self._lock = threading.Lock()
        self._watching: Optional[socket.socket] = None
        self._interrupted = False

    @classmethod
    def from_address(cls, address: str) -> "EtcdKeyValueStore":
        """From ``etcd[s]://H:P[,H:P...]/PREFIX[?unavailable_timeout=S&cacert=...]`` (``.address``)."""
        parts = urlsplit(address)
        query = {name: values[0] for name, values in parse_qs(parts.query).items()}
        timeout = float(query.get("unavailable_timeout", DEFAULT_UNAVAILABLE_TIMEOUT))
        tls = TlsFiles(query.get("cacert"), query.get("cert"), query.get("key")) if parts.scheme == "etcds" else None
        return cls(parts.netloc.split(","), parts.path or "/peerstate/default/", unavailable_timeout=timeout, tls=tls)

    @classmethod
    def for_job(cls, url: str, job_id: str, unavailable_timeout: float = DEFAULT_UNAVAILABLE_TIMEOUT,
                tls: Optional[TlsFiles] = None) -> "EtcdKeyValueStore":
        """From what ``peerstate run --store`` takes (``etcd[s]://H:P[,H:P...]``) and the job id."""
        parts = urlsplit(url)
        if not parts.netloc or parts.path not in ("", "/"):
            raise InvalidArgumentError(f"--store {url!r}: an etcd store is etcd://HOST:PORT[,HOST:PORT...], or "
                                       "etcds://... for TLS (the job's keys go under /peerstate/<--job-id>/)")
        if parts.scheme == "etcds":
            tls = tls or TlsFiles()
        elif tls and any(asdict(tls).values()):
            raise InvalidArgumentError(f"--store {url!r} is plain HTTP: the TLS files are for etcds://")
        return cls(parts.netloc.split(","), f"/peerstate/{job_id}/", unavailable_timeout=unavailable_timeout,
                   tls=tls if parts.scheme == "etcds" else None)

    @property
    def address(self) -> str:
        """What ``from_address`` reads back: the form the agent hands its workers."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.endpoints)
        scheme, files = (TLS_SCHEME, self.tls.query()) if self.tls else (SCHEME, "")
        return f"{scheme}{hosts}{self.prefix}?unavailable_timeout={self.unavailable_timeout:g}{files}"

    def describe(self) -> str:
        return f"etcd at {','.join(f'{h}:{p}' for h, p in self.endpoints)}{' (TLS)' if self.tls else ''}"

    # -- the contract ----------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self.set_many([(key, value)])

    def set_many(self, items: Sequence[Tuple[str, bytes]]) -> None:
        items = list(items)
        for start in range(0, len(items), MAX_TXN_OPS):
            chunk = items[start:start + MAX_TXN_OPS]
            self.count.sent(1, *(k for k, _ in chunk), *(v for _, v in chunk))
            self._post("/v3/kv/txn", {"success": [{"request_put": self._put(k, v)} for k, v in chunk]})

    def get(self, key: str) -> Optional[bytes]:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        return [value for value, _ in self._read(list(keys))[0]]

    def add(self, key: str, amount: int) -> int:
        def update(current: Optional[bytes]) -> Optional[bytes]:
            if amount == 0 and current is not None:
                return None
            return str(int(current or b"0") + amount).encode()

        return int(self._update(key, update))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self.count.sent(1, key, expected, desired)
        condition = {"target": "VALUE", "value": _b64(expected)} if expected else _ABSENT
        succeeded, (value, _) = self._put_if(key, condition, desired)
        return desired if succeeded else value or b""

    def append(self, key: str, value: bytes) -> None:
        self._update(key, lambda current: (current or b"") + value)

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.delete(key)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        found, revision = self._read(list(keys))
        missing = [key for key, (value, _) in zip(keys, found) if value is None]
        if missing:
            self._watch_for(missing, revision + 1, deadline)

    def wait_get(self, key: str, timeout: float) -> bytes:
        # One read when the key exists; else the value the watch event carries.
        [(value, _)], revision = self._read([key])
        if value is not None:
            return value
        return self._watch_for([key], revision + 1, time.monotonic() + timeout)[key]

    def clone(self) -> "EtcdKeyValueStore":
        return EtcdKeyValueStore([f"{h}:{p}" for h, p in self.endpoints], self.prefix,
                                 unavailable_timeout=self.unavailable_timeout, tls=self.tls, _count=self.count)

    def rendezvous_store(self):
        from peerstate.control.etcd_rendezvous import rendezvous_store

        # Counted apart: ``count`` is this client's own requests, as TorchKeyValueStore's is.
        return rendezvous_store(EtcdKeyValueStore([f"{h}:{p}" for h, p in self.endpoints], self.prefix,
                                                  unavailable_timeout=self.unavailable_timeout, tls=self.tls))

    # -- beyond the contract ------------------------------------------------------------
    def delete(self, key: str) -> bool:
        """Remove a key; whether it existed."""
        answer = self._post("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return int(answer.get("deleted", "0")) > 0

    def count_keys(self) -> int:
        """How many keys the job holds (everything under its prefix)."""
        start = self.prefix.encode()
        answer = self._post("/v3/kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(start)),
                                             "count_only": True})
        return int(answer.get("count", "0"))

    def interrupt(self) -> None:
        """Make a wait() blocked in another thread, and every later one, fail now
        (an abort of the rendezvous that uses this client)."""
        self._interrupted = True
        watching = self._watching
        if watching is not None:
            try:
                watching.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- implementation -------------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _put(self, key: str, value: bytes) -> Dict[str, str]:
        return {"key": _b64(self._key(key)), "value": _b64(bytes(value))}

    def _read(self, keys: List[str]) -> Tuple[List[Tuple[Optional[bytes], int]], int]:
        """((value or None, mod_revision) per key, the store's revision when it read them)."""
        found: List[Tuple[Optional[bytes], int]] = []
        revision = 0
        for start in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[start:start + MAX_TXN_OPS]
            self.count.sent(1, *chunk)
            answer = self._post("/v3/kv/txn", {"success": [{"request_range": {"key": _b64(self._key(k))}}
                                                           for k in chunk]})
            revision = revision or int(answer["header"]["revision"])
            found += [_first_kv(r["response_range"]) for r in answer.get("responses", [])]
        self.count.received([v for v, _ in found if v])
        return found, revision

    def _update(self, key: str, change) -> bytes:
        """Apply ``change(current value or None) -> new value`` atomically: a transaction
        that writes only if the key is as it was read, retried with what it found.
        ``change`` returning None means "leave it": the current value is returned."""
        [(current, modified)], _ = self._read([key])
        while True:
            desired = change(current)
            if desired is None:
                return current or b""
            self.count.sent(1, key, desired)
            condition = _ABSENT if current is None else {"target": "MOD", "mod_revision": str(modified)}
            succeeded, (current, modified) = self._put_if(key, condition, desired)
            if succeeded:
                return desired

    def _put_if(self, key: str, condition: Dict[str, str], value: bytes
                ) -> Tuple[bool, Tuple[Optional[bytes], int]]:
        """One transaction: put ``value`` at ``key`` if ``condition`` (an etcd compare
        without its key) holds. (Whether it did, the key's (value, mod_revision) when
        it did not.)"""
        full = _b64(self._key(key))
        answer = self._post("/v3/kv/txn", {"compare": [{"key": full, **condition}],
                                           "success": [{"request_put": self._put(key, value)}],
                                           "failure": [{"request_range": {"key": full}}]})
        if answer.get("succeeded"):
            return True, (value, 0)
        return False, _first_kv(answer["responses"][0]["response_range"])

    def _post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        payload = json.dumps(body)
        deadline: Optional[float] = None
        backoff = 0.02
        tried = 0
        last = ""
        while True:
            host, port = self.endpoints[self._current]
            try:
                with self._lock:
                    if self._connection is None:
                        self._connection = self._connect(host, port, self._request_timeout())
                    self._connection.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
                    response = self._connection.getresponse()
                    data = response.read()
                answer = json.loads(data or b"{}")
                if response.status == 200:
                    return answer
                if answer.get("code") in _UNAVAILABLE_CODES or response.status >= 500:
                    raise _Retry(answer.get("message") or answer.get("error") or f"HTTP {response.status}")
                raise InvalidArgumentError(f"{self.describe()} refused {path}: {answer.get('message', data[:200])}")
            except (OSError, http.client.HTTPException, ValueError, _Retry) as error:
                self._drop_connection()
                self._refuse_bad_tls(error, host, port)
                last = f"{host}:{port}: {error or type(error).__name__}"
            self._current = (self._current + 1) % len(self.endpoints)
            now = time.monotonic()
            deadline = deadline or now + self.unavailable_timeout
            if now >= deadline:
                raise StoreUnavailableError(
                    f"the job's store ({self.describe()}) did not answer for {self.unavailable_timeout:g}s "
                    f"(the store's unavailability bound, --store-timeout); last error: {last}")
            tried += 1
            if tried % len(self.endpoints) == 0:  # a round of every member: wait before the next
                time.sleep(min(backoff, max(deadline - now, 0)))
                backoff = min(backoff * 2, 0.5)

    def _connect(self, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
        if self._tls_context is None:
            return http.client.HTTPConnection(host, port, timeout=timeout)
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls_context)

    def _refuse_bad_tls(self, error: BaseException, host: str, port: int) -> None:
        """A certificate refused (ours or theirs) will be refused again: say so now."""
        if isinstance(error, ssl.SSLError) and not isinstance(error, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            raise InvalidArgumentError(f"the TLS handshake with etcd at {host}:{port} failed: {error} (check "
                                       "--store-cacert, --store-cert and --store-key)") from None

    def _request_timeout(self) -> float:
        return max(min(5.0, self.unavailable_timeout / 3), 0.5)

    def _drop_connection(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def _watch_for(self, keys: Sequence[str], revision: int, deadline: float) -> Dict[str, bytes]:
        """Block until every key of ``keys`` is put at ``revision`` or later, and return
        the values put (TimeoutError at the deadline). One watch covers them all: the
        range from the least to the greatest, the others in it ignored. A member lost
        mid-watch: the watch starts again on the next one from the same revision, so
        no put is missed."""
        missing = {self._key(k): k for k in keys}
        seen: Dict[str, bytes] = {}
        what = f"key {keys[0]!r}" if len(keys) == 1 else f"keys {list(keys)}"
        unreachable_since: Optional[float] = None
        while True:
            if self._interrupted:
                raise ConnectionAbortedError(f"the wait for {what} was interrupted")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} did not appear in {self.describe()} in time")
            low, high = min(missing), max(missing)
            body = json.dumps({"create_request": {"key": _b64(low), "range_end": _b64(high + b"\0"),
                                                  "start_revision": str(revision)}})
            host, port = self.endpoints[self._current]
            connection = self._connect(host, port, min(left, self._request_timeout()))
            try:
                self.count.sent(1, *missing.values())
                connection.request("POST", "/v3/watch", body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                if response.status != 200:
                    raise _Retry(f"HTTP {response.status}")
                self._watching = connection.sock
                unreachable_since = None
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{what} did not appear in {self.describe()} in time")
                    connection.sock.settimeout(left)
                    line = response.readline()
                    if self._interrupted:
                        raise ConnectionAbortedError(f"the wait for {what} was interrupted")
                    if not line:
                        raise _Retry("the watch stream ended")
                    result = json.loads(line).get("result", {})
                    if result.get("compact_revision"):
                        # history before ``revision`` is gone: what a read finds now is what was missed
                        names = list(missing.values())
                        found, now_at = self._read(names)
                        for name, (value, _) in zip(names, found):
                            if value is not None:
                                seen[name] = value
                                del missing[self._key(name)]
                        if not missing:
                            return seen
                        revision = now_at + 1
                        raise _Retry(f"history compacted past revision {revision - 1}")
                    if result.get("canceled"):
                        raise _Retry(result.get("cancel_reason", "watch canceled"))
                    for event in result.get("events", []):
                        if event.get("type", "PUT") != "PUT":
                            continue
                        name = missing.pop(base64.b64decode(event["kv"]["key"]), None)
                        if name is not None:
                            seen[name] = base64.b64decode(event["kv"].get("value", ""))
                            self.count.received([seen[name]])
                    if not missing:
                        return seen
            except socket.timeout:
                if deadline - time.monotonic() <= 0:
                    raise TimeoutError(f"{what} did not appear in {self.describe()} in time") from None
            except (OSError, http.client.HTTPException, ValueError, _Retry) as error:
                if self._interrupted:
                    raise ConnectionAbortedError(f"the wait for {what} was interrupted") from None
                self._refuse_bad_tls(error, host, port)
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= self.unavailable_timeout:
                    raise StoreUnavailableError(
                        f"the job's store ({self.describe()}) did not answer a watch for "
                        f"{self.unavailable_timeout:g}s (--store-timeout); last error: {error}") from None
                self._current = (self._current + 1) % len(self.endpoints)
                time.sleep(0.05)
            finally:
                self._watching = None
                connection.close()


def _first_kv(response_range: Dict[str, Any]) -> Tuple[Optional[bytes], int]:
    kvs = response_range.get("kvs") or []
    if not kvs:
        return None, 0
    return base64.b64decode(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", "0"))


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


def _endpoint(text: str) -> Tuple[str, int]:
    text = text.strip()
    if text.startswith("http://"):
        text = text[len("http://"):]
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgumentError(f"an etcd endpoint must be HOST:PORT (got {text!r})")
    return host.strip("[]"), int(port)

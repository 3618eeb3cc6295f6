"""A store by its address: the one place that knows every ``KeyValueStore``
implementation an address can name (``kvstore``'s TCPStore, ``etcd_store``'s etcd),
so that neither of them imports the other."""

from __future__ import annotations

from peerstate.control.kvstore import KeyValueStore, TorchKeyValueStore
from peerstate.errors import InvalidArgumentError


def is_etcd(address: str) -> bool:
    """Whether a store address names an etcd cluster (``etcd://`` or ``etcds://``)."""
    return address.startswith(("etcd://", "etcds://"))


def open_store(address: str, *, timeout: float, host_store: bool = False) -> KeyValueStore:
    """The store an address names: ``etcd[s]://H:P[,H:P...]/PREFIX[?...]``
    (``EtcdKeyValueStore.address``) or ``HOST:PORT`` of a TCPStore, which this process
    hosts when ``host_store``. InvalidArgumentError for anything else."""
    if is_etcd(address):
        from peerstate.control.etcd_store import EtcdKeyValueStore

        return EtcdKeyValueStore.from_address(address)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgumentError(f"a store address is HOST:PORT (a TCPStore) or etcd://HOST:PORT[,HOST:PORT...] "
                                   f"(got {address!r})")
    return TorchKeyValueStore(host, int(port), host_store=host_store, timeout=timeout)

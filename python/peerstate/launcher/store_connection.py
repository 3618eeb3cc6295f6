"""How an agent reaches the job's store: a TCPStore that node 0's agent hosts
(``--store HOST:PORT``), or an etcd cluster every agent is a client of
(``--store etcd://HOST:PORT[,HOST:PORT...] --job-id NAME``, ``etcds://`` with
TLS), where node 0 is a node like any other."""

from __future__ import annotations

from typing import Optional, Tuple

from peerstate.control import keys
from peerstate.control.etcd_store import EtcdKeyValueStore, TlsFiles
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.stores import is_etcd, open_store
from peerstate.errors import InvalidArgumentError, JobFailedError


def check_store_flags(store: str, job_id: Optional[str], store_timeout: float) -> None:
    """InvalidArgumentError naming the flag that is wrong."""
    if is_etcd(store):
        if not job_id or "/" in job_id:
            raise InvalidArgumentError("--store etcd://... needs --job-id NAME (no '/'): the job's keys live under "
                                       "/peerstate/NAME/, one name per run (under Slurm: slurm-SLURM_JOB_ID)")
        if store_timeout <= 0:
            raise InvalidArgumentError(f"--store-timeout must be positive (got {store_timeout})")
    elif ":" not in store:
        raise InvalidArgumentError(f"--store must be HOST:PORT or etcd[s]://HOST:PORT[,HOST:PORT...] (got {store!r})")


def open_job_store(store: str, node: int, job_id: Optional[str], store_timeout: float, join_timeout: float,
                   tls: Optional[TlsFiles] = None) -> Tuple[KeyValueStore, bool]:
    """(the store, whether this agent hosts it). Reaches it now: JobFailedError when a
    TCPStore cannot be hosted or reached, StoreUnavailableError when etcd does not
    answer within ``store_timeout``, InvalidArgumentError for a refused certificate."""
    if is_etcd(store):
        kv = EtcdKeyValueStore.for_job(store, job_id or "", unavailable_timeout=store_timeout, tls=tls)
        kv.get(keys.CONFIG)
        return kv, False
    hosts = node == 0
    try:
        return open_store(store, timeout=join_timeout, host_store=hosts), hosts
    except InvalidArgumentError:
        raise
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
        raise JobFailedError(f"node {node} could not {'host' if hosts else 'reach'} the job's store at {store}: "
                             f"{error}") from None

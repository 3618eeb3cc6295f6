"""The nccl transport, wired through the job's key-value store.

Rank 0 makes an NCCL unique id and publishes it under ``key``; every rank
reads it and joins the transport's own communicator (separate from the
training's process groups, so aborting one leaves the other alone). libnccl is
found at run time; where it is missing or too old this raises
UnavailableError naming what was found, and only then.
"""

from __future__ import annotations

from typing import Any

from peerstate import _C
from peerstate.control import keys


def nccl_transport(store: Any, rank: int, world_size: int, device: int, *, key: str = keys.NCCL_ID,
                   timeout: float = 60.0) -> "_C.Transport":
    """Create this rank's nccl transport. ``store`` is the job's store
    (``torch.distributed.TCPStore`` or anything with ``set(key, bytes)`` and a
    blocking ``get(key)``); use a fresh ``key`` per communicator (e.g. per epoch)."""
    if rank == 0:
        store.set(key, _C.nccl_unique_id())
    unique_id = store.get(key)
    return _C.nccl_transport(unique_id, world_size, rank, device, int(timeout * 1000))

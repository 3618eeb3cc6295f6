"""The credentials an agent gives its workers (csrc/net/credentials.h); the
simulated agents of ``tools.simulation`` issue them too.

Only agents hold the job secret, and from it the job's authority. Each worker
process gets a private key of its own, the job's public key and, for the rank
it holds, the authority's certificate: an initial worker in its environment, a
spare in the node channel when a plan gives it a rank (``NodeRelay``). So a
worker can speak on the replication ports only as the rank it was given. What
this does not stop: a process that reads another's memory (same-node workers
may: ``replication.stopped_holder``) or its agent's secret (its environment or
``--secret-file``, readable by the same user) takes what it reads; run workers
as another user than their agent where that matters.
"""

from __future__ import annotations

import secrets
from typing import Dict, Optional, Tuple

from peerstate import _C


class WorkerKeys:
    """The job's authority and the private key of every worker this agent started."""

    def __init__(self, secret: bytes) -> None:
        self._authority = _C.JobAuthority(secret)
        self._keys: Dict[str, bytes] = {}

    @property
    def job_key(self) -> bytes:
        return self._authority.public_key

    def new_worker(self, worker: str, rank: Optional[int]) -> Tuple[bytes, Optional[bytes]]:
        """A fresh private key for ``worker`` and, if it starts with a rank, its certificate."""
        key = secrets.token_bytes(32)
        self._keys[worker] = key
        return key, None if rank is None else self._authority.certify(rank, key)

    def certify(self, worker: str, rank: int) -> Optional[bytes]:
        """The certificate of ``rank`` for ``worker`` (None: not one of this agent's)."""
        key = self._keys.get(worker)
        return None if key is None else self._authority.certify(rank, key)

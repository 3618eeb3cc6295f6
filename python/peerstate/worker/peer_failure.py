"""Telling a peer's failure, seen from here, from the script's own error: a step's
guard and a replacement's recovery wait for the coordinator to declare a failure
only for the first kind; no recovery is coming for the second unless this rank dies."""

from __future__ import annotations

from peerstate.errors import Error

# What a collective's or a transport's error says when its peer died or its group was
# aborted (gloo raises plain RuntimeErrors; NCCL and the c10d store raise DistErrors).
_PEER_FAILURE_MARKS = ("gloo", "nccl", "c10d", "processgroup", "connection closed by peer", "connection reset",
                       "broken pipe", "timed out waiting", "aborted", "socket")


def raised_by_a_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) may be a peer's failure
    seen from here: a torch.distributed error, a gloo/NCCL error, one of peerstate's.
    Anything else is the script's own (a bug, a bad batch, an out-of-memory): no
    recovery is coming for it unless this rank dies, so waiting for one only holds the
    other ranks in their collectives for ``failure_grace``."""
    import torch.distributed

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (torch.distributed.DistError, Error)):
            return True
        if isinstance(error, (RuntimeError, OSError)) and any(m in str(error).lower() for m in _PEER_FAILURE_MARKS):
            return True
        error = error.__cause__ or error.__context__
    return False

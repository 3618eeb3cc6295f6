"""peerstate: checkpointless training.

Every step's training state is snapshotted into memory and replicated to buddy
ranks, so a failed rank is replaced and back in seconds while the healthy ranks
stay in their processes. ``import peerstate`` needs no GPU, CUDA, torch or numpy.
"""

import importlib
from typing import Any, List

from peerstate.errors import *  # noqa: F401,F403 - a leaf: the errors are light and raised everywhere
from peerstate.errors import __all__ as _error_names

# The public names, imported when first used (PEP 562): the root imports no plane, so
# any module may import ``peerstate._C`` or ``peerstate.errors`` without the root
# pulling in the worker, and the planes import one way (tests/test_layering.py).
_EXPORTS = {
    "BuddyPlacement": "peerstate.replication.placement",
    "ByteRange": "peerstate.state.buffers",
    "DataParallelShares": "peerstate.replication.placement",
    "Job": "peerstate.worker.job",
    "PlacementWarning": "peerstate.replication.placement",
    "Replication": "peerstate.replication.endpoint",
    "SnapshotHandle": "peerstate.state.snapshot",
    "SnapshotStore": "peerstate.state.snapshot",
    "register_training_state": "peerstate.state.training_state",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'peerstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"


def cuda_compiled() -> bool:
    """True when this build includes the CUDA device path (built with nvcc)."""
    from peerstate import _C

    return _C.cuda_compiled()


def cuda_available() -> bool:
    """True when the build has CUDA and this machine has a usable GPU."""
    from peerstate import _C

    return _C.cuda_available()


__all__ = [
    "BuddyPlacement",
    "ByteRange",
    "DataParallelShares",
    "Job",
    "PlacementWarning",
    "Replication",
    "SnapshotHandle",
    "SnapshotStore",
    "cuda_available",
    "cuda_compiled",
    "register_training_state",
    *_error_names,
]

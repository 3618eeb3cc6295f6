"""peerstate: checkpointless training.

Every step's training state is snapshotted into memory and replicated to buddy
ranks, so a failed rank is replaced and back in seconds while the healthy ranks
stay in their processes. ``import peerstate`` needs no GPU, CUDA, torch or numpy.
"""

from peerstate import _C
from peerstate.state.buffers import ByteRange
from peerstate.errors import *  # noqa: F401,F403
from peerstate.errors import __all__ as _error_names
from peerstate.replication.placement import BuddyPlacement, DataParallelShares, PlacementWarning
from peerstate.worker.job import Job
from peerstate.replication.endpoint import Replication
from peerstate.state.snapshot import SnapshotHandle, SnapshotStore
from peerstate.state.training_state import register_training_state

__version__ = "0.1.0"


def cuda_compiled() -> bool:
    """True when this build includes the CUDA device path (built with nvcc)."""
    return _C.cuda_compiled()


def cuda_available() -> bool:
    """True when the build has CUDA and this machine has a usable GPU."""
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

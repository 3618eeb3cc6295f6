"""The disk-checkpoint fallback (``torch.distributed.checkpoint``): written every
``every`` steps, read when a failure took every copy of some rank's state.

A checkpoint directory is complete once DCP wrote its ``.metadata`` (last, after
every rank's file), and a complete one is never written again: a step replayed
after a fallback to an older checkpoint holds the same state (the resume is
bitwise), and DCP would rewrite the files in place under the old ``.metadata``,
so a rank lost in the middle of that write left a torn checkpoint that still
looked complete (the soak met it: every replacement of that rank then failed to
load it)."""

from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

from peerstate.errors import InvalidArgumentError
from peerstate.worker.rebuild import DistributedWrappers
from peerstate.worker.tracked_state import TrackedState


def _complete(path: str) -> bool:
    """Whether checkpoint directory ``path`` is complete: DCP writes .metadata last."""
    return os.path.exists(os.path.join(path, ".metadata"))


def latest_checkpoint(directory: Optional[str]) -> Optional[Tuple[int, str]]:
    """(step, path) of the newest complete checkpoint in ``directory``."""
    if not directory or not os.path.isdir(directory):
        return None
    done = [name for name in os.listdir(directory)
            if name.startswith("step_") and _complete(os.path.join(directory, name))]
    if not done:
        return None
    newest = max(done)
    return int(newest[5:]), os.path.join(directory, newest)


class DiskCheckpoints:
    """This rank's checkpoints of ``tracked`` under ``directory`` (None: none are written),
    with the bucket layouts of ``wrappers``' DDPs: a job that resumes from one builds
    its DDPs with them, as a recovery does (``RebuildableDDP`` says why). ``fail_job``
    (``Coordinator.fail_job``) stops the job when a checkpoint cannot be loaded."""

    def __init__(self, tracked: TrackedState, wrappers: DistributedWrappers, directory: Optional[str],
                 every: int, fail_job: Callable[[str], str]) -> None:
        self.tracked = tracked
        self.wrappers = wrappers
        self.directory = directory
        self.every = every
        self._fail_job = fail_job

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def latest(self) -> Optional[Tuple[int, str]]:
        return latest_checkpoint(self.directory)

    def save(self, step: int, rank: int) -> None:
        """Write step ``step``'s checkpoint (collective: every rank calls it at the same
        step), unless a complete one of that step exists (see the module docstring);
        every rank sees the same directory, so they all skip it or all write it."""
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.directory, f"step_{step:09d}")
        if _complete(path):
            return
        for store in self.tracked.all_stores():
            store.wait()
        state = self.tracked.checkpoint_state(rank)
        state[f"rank{rank}/ddp_layouts"] = [wrapper.bucket_layout() for wrapper in self.wrappers.ddps]
        dcp.save(state, checkpoint_id=path)

    def load(self, path: str, step: int, rank: int) -> None:
        """Load checkpoint ``path`` (of step ``step``) into this rank's tracked state. One
        that does not fit, or cannot be read, stops the job (InvalidArgumentError, with
        DCP's cause): every worker given this rank would meet it, spare after spare."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        state = self.tracked.checkpoint_state(rank)
        state[f"rank{rank}/ddp_layouts"] = []
        try:
            dcp.load(state, checkpoint_id=path, no_dist=True)
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - several types for a misfit
            cause = (str(error).strip().splitlines() or [type(error).__name__])[-1]  # DCP's ends with the cause
            raise InvalidArgumentError(self._fail_job(
                f"rank {rank} could not load the disk checkpoint {path}: {cause}. A checkpoint fits a job with "
                "the same world size, the same tracked state and the same data_parallel setting; to start "
                "afresh, give the job another --checkpoint-dir.")) from None
        self.tracked.apply_checkpoint(state, rank, step)
        self.wrappers.saved_layouts = state[f"rank{rank}/ddp_layouts"]

"""The disk-checkpoint fallback (``torch.distributed.checkpoint``): written every
``every`` steps, read when a failure took every copy of some rank's state."""

from __future__ import annotations

import os
from typing import Optional, Tuple

from peerstate.worker.tracked_state import TrackedState


def latest_checkpoint(directory: Optional[str]) -> Optional[Tuple[int, str]]:
    """(step, path) of the newest complete checkpoint in ``directory`` (DCP writes
    .metadata last, so a directory without it is incomplete)."""
    if not directory or not os.path.isdir(directory):
        return None
    done = [name for name in os.listdir(directory)
            if name.startswith("step_") and os.path.exists(os.path.join(directory, name, ".metadata"))]
    if not done:
        return None
    newest = max(done)
    return int(newest[5:]), os.path.join(directory, newest)


class DiskCheckpoints:
    """This rank's checkpoints of ``tracked`` under ``directory`` (None: none are written)."""

    def __init__(self, tracked: TrackedState, directory: Optional[str], every: int) -> None:
        self.tracked = tracked
        self.directory = directory
        self.every = every

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def latest(self) -> Optional[Tuple[int, str]]:
        return latest_checkpoint(self.directory)

    def save(self, step: int, rank: int) -> None:
        import torch.distributed.checkpoint as dcp

        for store in self.tracked.all_stores():
            store.wait()
        dcp.save(self.tracked.checkpoint_state(rank), checkpoint_id=os.path.join(self.directory, f"step_{step:09d}"))

    def load(self, path: str, step: int, rank: int) -> None:
        import torch.distributed.checkpoint as dcp

        state = self.tracked.checkpoint_state(rank)
        dcp.load(state, checkpoint_id=path, no_dist=True)
        self.tracked.apply_checkpoint(state, rank, step)

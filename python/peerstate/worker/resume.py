"""Resuming a new job from the newest disk checkpoint of its ``--checkpoint-dir``
(``Job.track``), so that a job stopped or failed for good goes on where it was."""

from __future__ import annotations

import json
import sys
from typing import Optional, Tuple

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog
from peerstate.worker.checkpoint import DiskCheckpoints
from peerstate.worker.step_boundary import StepBoundary
from peerstate.worker.tracked_state import TrackedState


class CheckpointResume:
    """Finds and loads a new job's resume point. Every member loads the same
    checkpoint: the first member to look names it in the store."""

    def __init__(self, kv: KeyValueStore, checkpoints: DiskCheckpoints,
                 boundary: StepBoundary, tracked: TrackedState, events: EventLog) -> None:
        self._kv = kv
        self._checkpoints = checkpoints
        self._boundary = boundary
        self._tracked = tracked
        self._events = events

    def point(self, new_job: bool) -> Optional[Tuple[int, str]]:
        """(step, path) of the checkpoint to resume from; None without a checkpoint
        directory, without a complete checkpoint in it, or when this member is not
        starting a new job (``new_job`` False: a replacement, or a job under way)."""
        if not self._checkpoints.directory or not new_job:
            return None
        found = self._checkpoints.latest()
        step_and_path = json.loads(self._kv.compare_set(keys.RESUME, b"", json.dumps(found or "").encode()))
        return (int(step_and_path[0]), step_and_path[1]) if step_and_path else None

    def load(self, step: int, path: str, rank: int) -> int:
        """Register the tracked state and load checkpoint ``path`` into it; returns the
        step the loop goes on at. A checkpoint that does not fit stops the job (every
        rank, and any replacement, would fail the same) with DCP's cause."""
        self._boundary.register()
        self._checkpoints.load(path, step, rank)  # one that does not fit stops the job
        self._tracked.remember_rng()  # Job.guard says so if a seed after track() replaces what was loaded
        self._events.write("resumed", rank=rank, step=step, path=path)
        if rank == 0:
            print(f"peerstate: resumed from the disk checkpoint of step {step} ({path}); the loop goes on at step "
                  f"{step + 1}", file=sys.stderr, flush=True)
        return step + 1

"""What the script runs between two guarded steps that a recovery does not cover.

Collectives: a peer that fails while one runs is not recovered there: the
collective raises outside ``job.guard()`` and the rank exits, or waits out its
timeout. torch counts each group's collectives (p2p included) in its sequence
number; a count that moved between the end of one step's guard and the start
of the next is such a collective.

Random draws: a recovery rolls every member back to a step's end (its RNG
states included) and runs on from the next ``steps()`` iteration, so a draw
made after a guard (an evaluation that samples, a loader that shuffles after
the step) is not made again and the replayed steps draw other numbers; one made
before the guard is replayed, but only where it does not depend on the step. A
generator whose state moved between two guards is such a draw."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from peerstate.state.training_state import rng_fingerprint
from peerstate.worker import torch_private


class UnguardedCollectives:
    """``mark(epoch)`` at a step's clean end, ``moved(epoch)`` at the next guard: the
    groups (by description) whose count moved in between, within the same epoch."""

    def __init__(self, groups: Callable[[], List[Any]]) -> None:
        self._groups = groups  # the process groups to count (peerstate's own, this epoch)
        self._marked: Optional[Dict[Any, int]] = None
        self._epoch: Optional[int] = None
        self._said = False

    def mark(self, epoch: int) -> None:
        self._marked, self._epoch = self._counts(), epoch

    def cause(self, epoch: int, step: int) -> Optional[str]:
        """What to report at the guard of ``step``, the first time counts moved (None
        otherwise, and every time after: once said, it is not said again)."""
        moved = [] if self._said else self.moved(epoch)
        if not moved:
            return None
        self._said = True
        return (f"the collectives of {', '.join(moved)} ran between the end of step {step - 1}'s guard and step "
                f"{step}'s. A rank that fails while one runs is not recovered: the others raise outside the guard "
                "and exit, or wait out the collective's timeout. Run them inside job.guard() (a metric's "
                "all_reduce, a barrier, a checkpoint's collectives).")

    def moved(self, epoch: int) -> List[str]:
        if self._marked is None or self._epoch != epoch:
            return []
        import torch.distributed as dist

        now = self._counts()
        return [f"ranks {dist.get_process_group_ranks(group)}"
                + (f" ({group.group_desc})" if getattr(group, "group_desc", "undefined") != "undefined" else "")
                for group, count in now.items() if count != self._marked.get(group, count)]

    def _counts(self) -> Dict[Any, int]:
        counts = {}
        for group in self._groups():
            try:
                counts[group] = torch_private.sequence_number(group)
            except Exception:  # noqa: BLE001 - a backend that keeps no count (fake): not watched
                continue
        return counts


class UnguardedDraws:
    """``mark(epoch)`` at a step's clean end, ``cause(epoch, step)`` at the next guard:
    the generators (Python's, NumPy's, torch's, CUDA's) whose state moved in between,
    said once (then no longer captured: two captures a step, ~20 us, until then)."""

    def __init__(self) -> None:
        self._marked: Optional[Dict[str, Any]] = None
        self._epoch: Optional[int] = None
        self._said = False

    def mark(self, epoch: int) -> None:
        if not self._said:
            self._marked, self._epoch = rng_fingerprint(), epoch

    def cause(self, epoch: int, step: int) -> Optional[str]:
        if self._said or self._marked is None or self._epoch != epoch:
            return None  # nothing marked in this epoch: a recovery restored the states since
        now = rng_fingerprint()
        moved = [name for name, value in now.items() if name in self._marked and value != self._marked[name]]
        if not moved:
            return None
        self._said = True
        return (f"random numbers were drawn from {', '.join(moved)}'s global generator between the end of step "
                f"{step - 1}'s guard and step {step}'s. A recovery rolls back to a step's end and runs on from the "
                "next guard: a draw after a guard is not made again, and one before it only as it was if it does "
                "not depend on the step, so a run that recovers would not be bitwise. Draw inside job.guard(), or "
                "from a torch.Generator seeded by the step (docs/training-script.md).")

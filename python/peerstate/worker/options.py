"""What a ``peerstate.Job`` is asked for (``JobOptions``): its keyword arguments,
checked once, with what each one means."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from peerstate.errors import InvalidArgumentError

DATA_PARALLEL_SHARES_VARIABLE = "PEERSTATE_DATA_PARALLEL_SHARES"  # the benchmarks set it for a script


@dataclass(frozen=True)
class JobOptions:
    """``peerstate.Job``'s keyword arguments; construction raises InvalidArgumentError,
    naming the option, for a combination that cannot work.

    Attributes:
        snapshot_every: snapshot (and replicate) every N steps; a failure costs at
            most N steps of work.
        versions: snapshot versions kept per rank: 4 or more (the default, 4: nothing
            on the step's path, whatever the redundancy), 3 or 2 (less memory, for a
            wait on the step's path: a job that does not fit is refused at its first
            step, naming this option; ``tools.goodput_modes`` weighs them).
            With 4 the pipeline is lazy: a rank copies version v during the forward
            and backward of v+1 and pushes it from the optimizer step of v+1, after
            waiting there for the push of v-1, so while it is inside step v+2 (which
            a member may have finished) only v-1 is certain at its buddy, and the
            member must still hold v-1, 3 behind its newest. With 3 it is eager: v
            is copied at its boundary (the step waits for the copy: what a plain
            memcpy of the state costs) and pushed at once, and the optimizer step of
            v+1 waits for the push to land (only for what of it outlasts a forward
            and backward): one version fewer in every store. With 2 it is synced:
            v is copied beside the forward of v+1 and pushed as soon as it is
            copied, and the step waits for its round where the model's forward
            returns, before the backward's collectives, so no rank overwrites v-1
            before v landed everywhere (the step waits for what of the copy and the
            push outlasts a forward; ``StepBoundary``).
        k: copies of each rank's state on other ranks.
        parity_group: instead of copies, erasure-coded parity groups of this many
            ranks on different nodes (3 or more; 0, the default: buddies, ``k``). Each
            rank holds two parity blocks of 1/(g - 1) of its state for its group
            instead of two regions of a whole copy per buddy; one loss per group is
            rebuilt from the parity and the other members' own snapshots, two
            fall back to the disk checkpoint (``replication.parity``).
        backend: "gloo" or "nccl" (default: nccl when CUDA is available).
        checkpoint_dir: where a disk checkpoint (torch.distributed.checkpoint) is
            written every ``checkpoint_every`` steps, the fallback when a failure
            takes every copy of some rank's state (default: the agent's
            ``--checkpoint-dir`` and ``--checkpoint-every``).
        join_timeout: seconds to wait for every member while joining an epoch.
        failure_grace: seconds an error in the loop that may be a peer's failure (a
            torch.distributed, gloo, NCCL or peerstate error) waits for the coordinator
            to declare one before it is treated as a bug and raised. Any other error is
            the script's own and is raised at once: the rank exits, and a spare takes it.
        abort_timeout: seconds the training loop may take, after a failure aborted
            the groups, to leave the call it is in and start the recovery. Past it
            this process exits with ``ABORT_DEADLINE_EXIT_CODE`` and a spare takes
            its rank: the last resort against a call no abort can wake (a kernel
            that never returns, a blocking call outside peerstate's groups).
            Shorter than ``join_timeout``; longer than the loop ever runs
            between two collectives. With gloo, collectives also time out after
            ``abort_timeout / 2`` (a send gloo was writing when its peer died
            waits for that timeout whatever the abort does; see
            ``process_groups``): raise it if ranks wait longer on each other.
            A collective that times out while every rank lives (a busy rank)
            makes the job regroup at the last common step with twice the
            timeout, said on stderr (``regroup``). Point-to-point waits (a
            pipeline's sends and receives) wait as long. And a gloo group's
            formation is given up when it completes no group for
            ``min(abort_timeout / 10, FORM_CONNECT_TIMEOUT)`` (2 s) at the start,
            or 0.5 s at most in a recovery (``RECOVERY_CONNECT_TIMEOUT``): a
            member that is late holds the others that long (one that died is
            ended by the next epoch's abort); a formation that times out with no
            member lost (one was late) makes the same members form it again in
            a new epoch (``EpochJoiner._form``).
        data_parallel_shares: with ``track(data_parallel=...)``, how many shares the
            data-parallel state is split into for snapshots (``DataParallelShares``):
            the i-th rank of a node snapshots share i % shares. Default: one share
            per rank of a node when the job has two nodes or more (each node keeps
            one full copy), else 1 (every rank keeps a full copy); under HSDP, 1.
            Fewer bytes per step per rank; a recovery pulls the shares a rank
            lacks. Unset here, read from ``PEERSTATE_DATA_PARALLEL_SHARES``
            (``shares()``); checked at ``track()``.
        replica_budget_bytes, snapshot_threads: passed to the stores.
    """

    snapshot_every: int = 1
    versions: int = 4
    k: int = 1
    parity_group: int = 0
    backend: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    join_timeout: float = 120.0
    failure_grace: float = 30.0
    replica_budget_bytes: Optional[int] = None
    snapshot_threads: Optional[int] = None
    abort_timeout: float = 60.0
    data_parallel_shares: Optional[int] = None

    def __post_init__(self) -> None:
        if not 0 < self.abort_timeout < self.join_timeout:
            raise InvalidArgumentError(f"abort_timeout must be positive and shorter than join_timeout, which the "
                                       f"other members wait for this one (got {self.abort_timeout} and "
                                       f"{self.join_timeout})")
        if self.snapshot_every < 1 or self.versions < 2:
            raise InvalidArgumentError(f"need snapshot_every >= 1 and versions >= 2 (got {self.snapshot_every}, "
                                       f"{self.versions}): one version leaves nothing to recover while the next is "
                                       "copied (2 copies each version beside the next forward and waits for its push "
                                       "where that forward returns; 3 copies it at its step's end and waits at the "
                                       "next optimizer step; 4, the default, waits for neither)")
        if self.parity_group and (self.parity_group < 3 or self.k != 1):
            raise InvalidArgumentError(f"parity_group={self.parity_group} with k={self.k}: a parity group has 3 "
                                       "members or more (2 is a mirror: use k=1), and it replaces the buddies, so k "
                                       "stays 1")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise InvalidArgumentError("checkpoint_every needs a checkpoint_dir")

    def shares(self) -> Optional[int]:
        """``data_parallel_shares``, or the environment's when it is not given."""
        if self.data_parallel_shares is None and os.environ.get(DATA_PARALLEL_SHARES_VARIABLE):
            return int(os.environ[DATA_PARALLEL_SHARES_VARIABLE])
        return self.data_parallel_shares

"""The private torch APIs peerstate relies on, each behind one function here.

torch has no public API for what a recovery does to the groups and wrappers of
a live process: re-forming the default group under the same names, aborting
every group at once, creating a mesh's groups under a given timeout, handing
DDP a bucket layout, repointing FSDP2's cached groups. Every use of a private
name goes through this module, so a torch release that changes one shows up
in one place, and ``tests/worker/test_torch_private.py`` checks each against
the installed torch (one test per reference: it fails when torch changes it).
Where torch has a public API for the same, it is used from the release that
has it (``set_group_timeout``: ``torch.distributed.set_timeout`` from 2.14).

Tested with torch 2.13 (CI's pin: the whole suite) and 2.14 (2.14.1: the worker, control and
recovery tests, also in CI): ``Job()`` says so on stderr under any other release (``untested_torch``).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Callable, Dict, Iterator, List, Optional

TESTED_TORCH = ((2, 13), (2, 14))  # the releases CI runs the suite (2.13) or its torch-facing part (2.14) on


def _c10d() -> Any:
    import torch.distributed.distributed_c10d as c10d

    return c10d


def group_names() -> Dict[Any, str]:
    """Every process group of this process, to its name (torch's registry, live)."""
    return _c10d()._world.pg_names


def reset_group_naming() -> None:
    """Name the next groups from the start again: torch names a group after a
    per-process counter, reset only when a formed default group is destroyed."""
    _c10d()._world.group_count = 0


def default_group() -> Any:
    return _c10d()._get_default_group()


def is_member(group: Any) -> bool:
    """Whether this process is in ``group`` (what ``new_group`` returns to a non-member is a marker)."""
    return not _c10d()._rank_not_in_group(group)


def set_group_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """The timeout of ``group``'s collectives from now on (gloo: not its point-to-point
    waits, see ``process_groups``)."""
    import torch.distributed as dist

    public = getattr(dist, "set_timeout", None)  # torch 2.14
    (public or _c10d()._set_pg_timeout)(timeout, group)


def abort_all_groups() -> None:
    """Abort and destroy every group, the default one last (raises when none is formed)."""
    _c10d()._abort_process_group()


@contextlib.contextmanager
def one_nccl_call() -> Iterator[List[Any]]:
    """Yields every group, newest first, inside one NCCL group call (as torch's own
    abort of every group: separate aborts can deadlock each other, pytorch#119797);
    with no NCCL backend on the default group, outside any."""
    import torch

    world = dict(group_names())
    groups = sorted(world, key=lambda group: world[group], reverse=True)
    try:
        nccl = default_group()._get_backend(torch.device("cuda"))
        nccl._group_start()
    except Exception:  # noqa: BLE001 - destroyed meanwhile, or no NCCL backend to group the aborts
        nccl = None
    try:
        yield groups
    finally:
        if nccl is not None:
            nccl._group_end()


@contextlib.contextmanager
def groups_created_under(seconds: float) -> Iterator[None]:
    """Groups created inside (``new_group`` with no timeout: a ``DeviceMesh``'s, a
    builder's) get ``seconds`` as their timeout."""
    c10d = _c10d()
    default = c10d.default_pg_timeout
    c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    try:
        yield
    finally:
        c10d.default_pg_timeout = default


def mesh_group_names(mesh: Any) -> List[str]:
    """The names of a ``DeviceMesh``'s groups, one per dimension (it finds them by name)."""
    return list(mesh._dim_group_names)


def share_mesh_groups(into: Any, fresh: Any) -> None:
    """Let ``into`` resolve the groups ``fresh`` (the same mesh, made again) created,
    where torch.compile looks them up (by name, outside torch's registry)."""
    getattr(into, "_pg_registry", {}).update(getattr(fresh, "_pg_registry", {}))


@contextlib.contextmanager
def ddp_bucket_assignment(assign: Callable[..., Any]) -> Iterator[None]:
    """DDP built inside takes its bucket layout from ``assign`` (the signature of
    ``torch.distributed._compute_bucket_assignment_by_size``) instead of computing it."""
    import torch.distributed as dist

    compute = dist._compute_bucket_assignment_by_size
    dist._compute_bucket_assignment_by_size = assign
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = compute


def fsdp_param_group(module: Any) -> Any:
    """The parameter group of an FSDP2 (``fully_shard``) module, or None (another module,
    or one that manages no parameters)."""
    return module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None


def fsdp_ran(module: Any) -> bool:
    """Whether an FSDP2 root module has run an iteration (its lazy init sets the root)."""
    return module._get_fsdp_state()._is_root is not None


def sequence_number(group: Any) -> int:
    """How many operations ``group`` has run in this process (raises for a backend that
    keeps no count, a fake one)."""
    return group._get_sequence_number_for_group()


def pipeline_stages(schedule: Any) -> List[Any]:
    """The stages of a ``torch.distributed.pipelining`` schedule, one-stage or multi-stage."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def untested_torch() -> Optional[str]:
    """What to say when the installed torch is not a release CI tests (None when it is)."""
    import torch

    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release in TESTED_TORCH:
        return None
    tested = ", ".join(".".join(map(str, r)) for r in TESTED_TORCH)
    return (f"torch {torch.__version__} is not a release peerstate is tested with ({tested}): the private torch "
            "APIs a recovery relies on (peerstate.worker.torch_private) may have changed; "
            "tests/worker/test_torch_private.py checks each of them")

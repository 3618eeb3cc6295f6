"""The host memory a rank may hold for recoveries, checked before any of it is
allocated (``HostMemoryBudget``).

A rank holds ``versions`` copies of its own state and two regions of each
buddy's replica, all faulted in when allocated. Every store checks its own
budget, but nothing checked the node: eight ranks that each fit half of the
machine overcommit it fourfold, and the kernel's OOM killer then kills ranks
one after another, each replacement allocating the same. So each rank's total
must fit its share of the node's memory: the node's limit (the smallest of its
physical memory and the memory limits of the cgroups this process is in, or
``PEERSTATE_HOST_MEMORY``) divided by the ranks that run on it. That is a
necessary condition, not a sufficient one (the training's own host memory and
the hot spares' are not counted): what it refuses surely cannot fit. A refusal
stops the job at once, with the figures and what to do; every rank of the same
size would refuse the same.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, Mapping, Sequence, Tuple

from peerstate.errors import InvalidArgumentError

HOST_MEMORY_VARIABLE = "PEERSTATE_HOST_MEMORY"  # bytes, or with a K, M, G or T suffix (powers of 1024)
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str, source: str = HOST_MEMORY_VARIABLE) -> int:
    """``text`` as a byte count ("68719476736", "64G"); InvalidArgumentError naming ``source``."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = value[-1:] if value[-1:] in _SUFFIXES else ""
    try:
        number = float(value[:len(value) - len(suffix)])
    except ValueError:
        number = -1.0
    if number <= 0:
        raise InvalidArgumentError(f"{source}={text!r} is not a size: give bytes, or a number with K, M, G or T "
                                   "(e.g. 64G)")
    return int(number * _SUFFIXES[suffix])


def cgroup_limits(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> Dict[str, int]:
    """The memory limits of the cgroups this process is in, each with its file: v2's
    ``memory.max`` of its cgroup and every ancestor, v1's ``memory.limit_in_bytes``."""
    limits: Dict[str, int] = {}
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return limits
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            candidates = [root / path.lstrip("/")]
            candidates += [candidates[0].joinpath(*[".."] * up) for up in range(1, path.count("/") + 1)]
            files = [c.resolve() / "memory.max" for c in candidates]
        elif "memory" in controllers.split(","):
            files = [root / "memory" / path.lstrip("/") / "memory.limit_in_bytes"]
        else:
            continue
        for file in files:
            try:
                text = file.read_text().strip()
            except OSError:
                continue
            if text.isdigit():  # "max" (v2) is no limit; v1 says so with a huge number
                limits[str(file)] = int(text)
    return limits


def node_memory(env: Mapping[str, str] = os.environ) -> Tuple[int, str]:
    """(bytes, where that figure comes from) of the memory this node's ranks share."""
    if env.get(HOST_MEMORY_VARIABLE):
        return parse_bytes(env[HOST_MEMORY_VARIABLE]), HOST_MEMORY_VARIABLE
    found = {"physical memory": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")}
    found.update(cgroup_limits())
    source = min(found, key=found.__getitem__)
    return found[source], source


def size(nbytes: float) -> str:
    """``nbytes`` for a person: 1.19 GiB, 512.0 MiB, 64 KiB."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / (1 << 10):.0f} KiB"


class HostMemoryBudget:
    """One rank's share of its node's memory, for its own versions and the replicas
    it holds. ``fail_job(message)`` records why the job stops and returns the
    recorded reason (``Coordinator.fail_job``)."""

    def __init__(self, node_bytes: int, source: str, ranks_per_node: int, fail_job: Callable[[str], str]) -> None:
        self.node_bytes, self.source, self.ranks_per_node = node_bytes, source, ranks_per_node
        self.share = node_bytes // ranks_per_node
        self._fail_job = fail_job
        self._own = 0  # bytes of this rank's own versions, once checked
        self._versions = 0

    def own(self, rank: int, versions_bytes: int, versions: int) -> None:
        """Check ``versions_bytes`` (``versions`` of its own state) before they are allocated."""
        self._own, self._versions = versions_bytes, versions
        if versions_bytes > self.share:
            self._refuse(rank, f"{versions} versions of its own state take {size(versions_bytes)}")

    def replicas(self, rank: int, sizes: Mapping[int, int]) -> None:
        """Check the replicas of ``sizes`` (rank -> bytes of one version), two regions
        each, beside its own versions, before they are allocated."""
        held = 2 * sum(sizes.values())
        if self._own + held > self.share:
            # A replacement reserves its buddies' replicas before its own versions are checked.
            own = f"{self._versions} versions of its own state take {size(self._own)} and " if self._versions else ""
            self._refuse(rank, f"{own}two regions of each replica it holds for ranks {sorted(sizes)} take {size(held)}")

    def parity(self, rank: int, group: Sequence[int], block_bytes: int) -> None:
        """Check the two parity blocks it holds for its ``group`` beside its own versions."""
        held = 2 * block_bytes
        if self._own + held > self.share:
            own = f"{self._versions} versions of its own state take {size(self._own)} and " if self._versions else ""
            self._refuse(rank, f"{own}two parity blocks for its group {list(group)} take {size(held)}")

    def _refuse(self, rank: int, what: str) -> None:
        fewer = (f" keep fewer versions (Job(versions={self._versions}) now; 2 at least, at the cost of a copy and "
                 "a push the step waits for)," if self._versions > 2 else "")
        message = (f"rank {rank} cannot hold its state for recoveries in this node's memory: {what}, over its share "
                   f"of {size(self.share)} ({size(self.node_bytes)} from the node's {self.source}, for "
                   f"{self.ranks_per_node} ranks). Spread the state over more ranks or nodes (FSDP, more "
                   f"data-parallel shares),{fewer} or, if this node has more memory for it than that, say how much "
                   f"with {HOST_MEMORY_VARIABLE}")
        raise InvalidArgumentError(self._fail_job(message))

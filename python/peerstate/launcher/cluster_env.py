"""What ``peerstate run`` takes from the cluster launcher it runs under.

Slurm (``srun peerstate run ...``, one task per node): the node count from
``SLURM_NNODES``, this node's index from ``SLURM_NODEID``, and the store's
default host from the first host of ``SLURM_JOB_NODELIST`` (node 0 is where
Slurm puts the first task of a one-task-per-node step), at ``DEFAULT_STORE_PORT``.
A flag given on the command line always wins over the environment.
"""

from __future__ import annotations

import re
from typing import Dict, Mapping, Optional

from peerstate.errors import InvalidArgumentError

DEFAULT_STORE_PORT = 29400  # torch elastic's c10d rendezvous port


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``gpu[003-005,9],cpu1`` -> ``gpu003``."""
    match = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?([^,\s]*)", nodelist)
    if not match:
        raise InvalidArgumentError(f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm hostlist: pass --store HOST:PORT")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def slurm_defaults(environ: Mapping[str, str]) -> Dict[str, object]:
    """``nnodes``, ``node_rank``, ``store`` and ``job_id`` (``SLURM_JOB_ID``, the prefix of
    the job's keys in etcd) from a Slurm step's environment (empty outside Slurm)."""
    if "SLURM_NNODES" not in environ or "SLURM_NODEID" not in environ:
        return {}
    try:
        nnodes, node_rank = int(environ["SLURM_NNODES"]), int(environ["SLURM_NODEID"])
    except ValueError:
        raise InvalidArgumentError(f"SLURM_NNODES={environ['SLURM_NNODES']!r} and SLURM_NODEID="
                                   f"{environ['SLURM_NODEID']!r} must be integers: pass --nnodes and "
                                   "--node-rank") from None
    defaults: Dict[str, object] = {"nnodes": nnodes, "node_rank": node_rank}
    if environ.get("SLURM_JOB_ID"):
        defaults["job_id"] = f"slurm-{environ['SLURM_JOB_ID']}"
    nodelist: Optional[str] = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist and nnodes > 1:
        defaults["store"] = f"{first_host(nodelist)}:{DEFAULT_STORE_PORT}"
    return defaults

"""What ``peerstate run`` starts a node's agent with (``AgentConfig``), checked
before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from peerstate.control import progress
from peerstate.control.environment import SECRET_VARIABLE
from peerstate.control.etcd_store import DEFAULT_UNAVAILABLE_TIMEOUT, TlsFiles
from peerstate.errors import InvalidArgumentError
from peerstate.launcher.fork_server import DEFAULT_PRELOAD
from peerstate.launcher.store_connection import check_store_flags


@dataclass
class AgentConfig:
    script: List[str]                      # the script and its arguments
    nproc_per_node: int
    spares: int = 0
    nnodes: int = 1
    node_rank: int = 0
    store: str = "127.0.0.1:0"             # HOST:PORT of a TCPStore node 0 hosts (port 0: any free port),
                                           # or etcd://HOST:PORT[,HOST:PORT...] of an etcd cluster
    job_id: Optional[str] = None           # with etcd: the job's keys are under /peerstate/<job_id>/
    store_timeout: float = DEFAULT_UNAVAILABLE_TIMEOUT  # with etcd: how long it may not answer
    store_tls: Optional[TlsFiles] = None   # with etcds://: the CA, client certificate and key files
    host: str = "127.0.0.1"                # the address this node's workers listen on
    log_dir: str = "peerstate-logs"
    hang_timeout: float = 10.0             # a worker whose counter stops this long in its loop is killed
    # A worker whose native liveness count stops this long is frozen if the kernel has it stopped
    # or cgroup-frozen (launcher.kernel_state; starved of CPU, it is not): that count never waits
    # on the GIL or a peer, so the bound can be a few of its ticks, not a loop's worst step.
    freeze_timeout: float = 0.5
    lease_timeout: float = 3.0             # a node whose lease stops this long is lost
    spare_timeout: float = 60.0            # how long a plan waits for a spare to become ready
    join_timeout: float = 120.0            # how long nodes wait for each other at start
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    secret_file: Optional[str] = None      # the job secret, when PEERSTATE_SECRET is not set
    frame_protection: str = "authenticated"  # of the replication frames, the same on every node
    inject: List[str] = field(default_factory=list)  # fault specs (peerstate.launcher.inject)
    strict: bool = False                   # a resume found not bitwise stops the job (control.findings)
    extra_env: Dict[str, str] = field(default_factory=dict)
    # Modules a node's fork server imports once, its workers forked from it (launcher.fork_server);
    # empty: each worker starts its own interpreter.
    preload: List[str] = field(default_factory=lambda: list(DEFAULT_PRELOAD))

    def workers_environment(self, agent_environment: Mapping[str, str]) -> Dict[str, str]:
        """The environment every worker of this node shares, from the agent's (the agent
        adds each worker's own part)."""
        env = dict(agent_environment)
        env.pop(SECRET_VARIABLE, None)  # workers get credentials of their own rank instead (WorkerKeys)
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the watcher's timed-out waits are not news
        if self.host.startswith("127.") and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo binds where --host says, not the hostname's address
        if self.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes of all-core OpenMP pools thrash
        env.update(self.extra_env)
        return env

    def fork_server_environment(self, agent_environment: Mapping[str, str]) -> Dict[str, str]:
        """The environment of this node's fork server: its workers', and the job's event log,
        which marks a new-interpreter server and what it forks (whose /proc/PID/environ is
        the server's) as this job's processes."""
        events = str(Path(self.log_dir) / "events.jsonl")
        return dict(self.workers_environment(agent_environment), PEERSTATE_EVENTS=events)

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise InvalidArgumentError(f"--nproc-per-node must be >= 1 (got {self.nproc_per_node})")
        if not 0 <= self.spares <= self.nproc_per_node:
            raise InvalidArgumentError(
                f"--spares {self.spares} is not allowed: a node may keep 0 to --nproc-per-node "
                f"({self.nproc_per_node}) hot spares, one per worker slot; each spare is a full process "
                "(and, on GPU nodes, needs its own device)")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise InvalidArgumentError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1} (--nnodes)")
        if not self.script:
            raise InvalidArgumentError("give the training script to run: peerstate run [options] script.py [args]")
        if self.frame_protection not in ("authenticated", "encrypted", "trusted-fabric"):
            raise InvalidArgumentError(f"--frame-protection must be authenticated, encrypted or trusted-fabric (got "
                                       f"{self.frame_protection!r})")
        least = round(progress.FREEZE_INTERVALS * progress.TICK_SECONDS, 6)
        if not self.freeze_timeout >= least:
            raise InvalidArgumentError(
                f"--freeze-timeout {self.freeze_timeout} is too short: a worker's liveness count ticks every "
                f"{progress.TICK_SECONDS}s, and a bound under {progress.FREEZE_INTERVALS} ticks ({least:.1f}s) would "
                "take a merely late tick for a frozen process; give at least that")
        check_store_flags(self.store, self.job_id, self.store_timeout)

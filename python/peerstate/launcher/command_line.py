"""What ``peerstate run ARGS`` means: its flags (``add_run_arguments``), the
``AgentConfig`` they start (``agent_config``) and the agent's environment
(``agent_environment``). Here, not in ``peerstate.cli``, so that a tool starting
agents (``LocalJob``) reads a command line as the agent will."""

from __future__ import annotations

import argparse
from typing import Dict, Mapping, Sequence

from peerstate.control.etcd_store import TlsFiles
from peerstate.errors import InvalidArgumentError
from peerstate.launcher.cluster_env import slurm_defaults
from peerstate.launcher.config import AgentConfig
from peerstate.launcher.fork_server import DEFAULT_PRELOAD


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """The flags of ``peerstate run``."""
    run.add_argument("--nproc-per-node", type=int, required=True, help="workers on this node")
    run.add_argument("--spares", type=int, default=0, help="hot spares kept ready on this node (0..nproc-per-node)")
    run.add_argument("--nnodes", type=int, default=None, help="nodes in the job (default: SLURM_NNODES, else 1)")
    run.add_argument("--node-rank", type=int, default=None,
                     help="this node's index, node 0 hosts a TCPStore (default: SLURM_NODEID, else 0)")
    run.add_argument("--store", default=None, help="the job's store: HOST:PORT of a TCPStore that node 0 hosts "
                     "(port 0 = any; under Slurm: the first host of SLURM_JOB_NODELIST, port 29400), or "
                     "etcd://HOST:PORT[,HOST:PORT...] of an etcd cluster, which no node's loss takes down "
                     "(etcds://: TLS)")
    run.add_argument("--job-id", default=None, help="with etcd: the job's name, its keys' prefix; one per run "
                     "(default: slurm-SLURM_JOB_ID)")
    run.add_argument("--store-timeout", type=float, default=20.0, help="with etcd: seconds the store may not answer "
                     "before every agent stops its job")
    run.add_argument("--store-cacert", default=None, help="with etcds://: the CA that signed the members (PEM; "
                     "default: the system's CAs)")
    run.add_argument("--store-cert", default=None, help="with etcds://: this client's certificate (PEM)")
    run.add_argument("--store-key", default=None, help="with etcds://: this client's private key (PEM)")
    run.add_argument("--host", default="127.0.0.1", help="address this node's replication servers listen on")
    run.add_argument("--log-dir", default="peerstate-logs", help="worker logs and events.jsonl")
    run.add_argument("--hang-timeout", type=float, default=10.0, help="seconds a worker's heartbeat may stand "
                     "still in its loop before it is declared hung and killed (before its first step and while "
                     "it recovers: --join-timeout)")
    run.add_argument("--freeze-timeout", type=float, default=0.5, help="seconds a worker's native liveness count "
                     "(bumped every 0.1 s by a thread that never waits on the GIL or a peer) may stand still, in "
                     "any phase, before the agent asks the kernel; stopped (SIGSTOP, a debugger) or cgroup-frozen, "
                     "it is declared frozen and handled as hung, while one merely starved of CPU is not; at least "
                     "0.3")
    run.add_argument("--lease-timeout", type=float, default=3.0, help="seconds without a node's heartbeat "
                     "before it is declared lost")
    run.add_argument("--spare-timeout", type=float, default=60.0, help="seconds a recovery waits for a spare")
    run.add_argument("--join-timeout", type=float, default=120.0, help="seconds nodes wait for each other")
    run.add_argument("--checkpoint-dir", default=None, help="disk checkpoints (torch.distributed.checkpoint), "
                     "the fallback when every copy of a rank's state is lost")
    run.add_argument("--checkpoint-every", type=int, default=0, help="steps between disk checkpoints")
    run.add_argument("--frame-protection", default="authenticated",
                     choices=["authenticated", "encrypted", "trusted-fabric"],
                     help="replication frames after the handshake: an AES-256-GCM tag on each (default), also "
                          "encrypted, or no per-frame protection (trusted-fabric: an explicit opt-out for a network "
                          "whose every host is trusted)")
    run.add_argument("--secret-file", default=None,
                     help="the job secret (hex, mode 0600), when PEERSTATE_SECRET is not set; the same on every "
                          "node (created if absent on a one-node job). A one-node job without either makes one")
    run.add_argument("--inject", action="append", default=[], metavar="SPEC",
                     help="inject a fault, e.g. kill:rank=2:step=10, hang:rank=1:time=30, "
                          "kill-node:node=1:step=20, kill-spare:node=0:time=12, random:mtbf=20:seed=7:max=3 "
                          "(repeatable; peerstate.launcher.inject lists the kinds)")
    run.add_argument("--preload", default=",".join(DEFAULT_PRELOAD), metavar="MODULES",
                     help="modules this node's fork server imports once; every worker and spare is forked from it, "
                          "ready in the time its script takes to reach peerstate.Job() instead of an interpreter's "
                          "start and torch's import (comma-separated; add your script's heavy imports; '' starts "
                          "each worker with its own interpreter, as torchrun does)")
    run.add_argument("--strict", action="store_true",
                     help="stop the job when a worker finds that the run is no longer bitwise equal to a "
                          "fault-free one (without it, each finding is said on the console and in the summary)")
    run.add_argument("-m", "--module", action="store_true",
                     help="the script is a module, run as `python -m MODULE` would (as torchrun's -m): "
                          "peerstate run -m torchtitan.train ...")
    run.add_argument("script", help="the training script (a module's name with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def parse_run_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """``peerstate run``'s ARGS read as the command reads them (SystemExit, as argparse
    exits, on a bad one)."""
    run = argparse.ArgumentParser(prog="peerstate run")
    add_run_arguments(run)
    return run.parse_args(list(argv))


def agent_config(args: argparse.Namespace, environ: Mapping[str, str]):
    """The AgentConfig that ``peerstate run`` ARGS start (Slurm's environment fills what
    the flags leave out); InvalidArgumentError naming what is missing."""
    for name, value in slurm_defaults(environ).items():
        if getattr(args, name) is None:  # a flag on the command line wins
            setattr(args, name, value)
    nnodes = 1 if args.nnodes is None else args.nnodes
    store = args.store
    if store is None:
        if nnodes > 1:
            raise InvalidArgumentError("--nnodes > 1 needs --store HOST:PORT (node 0 hosts the store there) or "
                                       "--store etcd://HOST:PORT[,HOST:PORT...]")
        store = "127.0.0.1:0"
    script = ["-m", args.script] if args.module else [args.script]
    return AgentConfig(script=[*script, *args.script_args], nproc_per_node=args.nproc_per_node,
                       spares=args.spares, nnodes=nnodes, node_rank=0 if args.node_rank is None else args.node_rank,
                       store=store, host=args.host, log_dir=args.log_dir, hang_timeout=args.hang_timeout,
                       freeze_timeout=args.freeze_timeout, lease_timeout=args.lease_timeout,
                       spare_timeout=args.spare_timeout,
                       join_timeout=args.join_timeout, checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=args.checkpoint_every, inject=args.inject, strict=args.strict,
                       secret_file=args.secret_file,
                       frame_protection=args.frame_protection, job_id=args.job_id, store_timeout=args.store_timeout,
                       store_tls=TlsFiles(args.store_cacert, args.store_cert, args.store_key),
                       preload=[m.strip() for m in args.preload.split(",") if m.strip()])


def agent_environment(environ: Mapping[str, str]) -> Dict[str, str]:
    """The environment ``peerstate run`` gives its agent: ``environ`` and a default.
    Quiet when healthy: the agent's store clients wait on purpose (a watch, a lease), and
    c10d logs every such wait as a warning ("waitForInput ... timed out"). Read by torch
    when it loads; a user's own setting wins. Workers get the same default
    (``AgentConfig.workers_environment``)."""
    return {"TORCH_CPP_LOG_LEVEL": "ERROR", **environ}

"""The agent-to-worker contract: what ``peerstate run`` puts in the environment
of each process it starts, written by ``to_env()`` in the agent and read back,
validated, by ``from_env()`` in the worker.

Besides peerstate's own variables every process gets torchrun's: WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the TCPStore's; not set with
``--store etcd://``, which has no one address), GROUP_RANK, LOCAL_RANK, and RANK
for an initial worker, plus OMP_NUM_THREADS=1 unless the user set it (as
torchrun does for more than one process per node). What a script may rely on:

- an initial worker: all of them, from the start, as under torchrun;
- a hot spare, before ``track()`` returns: no RANK (it has none yet; reading it
  is a KeyError, as it would be for any process without a rank) and a
  *provisional* LOCAL_RANK, its slot modulo LOCAL_WORLD_SIZE, a device it may
  build on ahead of time (``PEERSTATE_ROLE=spare`` says which it is);
- a hot spare, after ``track()`` returns: RANK and LOCAL_RANK of the rank it took
  (``job.rank``; LOCAL_RANK = RANK mod LOCAL_WORLD_SIZE), so a script on a GPU
  node reads LOCAL_RANK again after ``track()`` before it picks its device.

No worker gets the job secret (PEERSTATE_SECRET is taken out of its
environment): its agent gives it a private key of its own, the job's public
key, and for an initial worker the certificate of its rank; a spare gets its
certificate with its rank, in the node channel (``keys.rank_certificate``). A
worker can therefore speak only as its own rank on the replication ports
(csrc/net/credentials.h).
"""

from __future__ import annotations

import os
import secrets
import signal
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Mapping, Optional

from peerstate.control.stores import is_etcd
from peerstate.errors import InvalidArgumentError

if TYPE_CHECKING:
    from peerstate import _C

# A worker that could not leave a blocked call within Job(abort_timeout=...) exits with this (EX_SOFTWARE).
ABORT_DEADLINE_EXIT_CODE = 70

# On this signal a worker prints every thread's stack to its log (faulthandler, registered with its
# heartbeat: it needs no GIL, so it answers from a thread stuck in native code too). Its agent sends
# it to a worker whose heartbeat stopped, before freezing or killing it, so a hang explains itself.
STACKS_SIGNAL = signal.SIGUSR2

# What a script that forms its own default group is told (by the worker, or by the agent when the
# call failed before peerstate.Job(): rank 0 finds MASTER_PORT taken by the job's store).
SCRIPT_DEFAULT_GROUP = (
    "remove the script's torch.distributed.init_process_group() call: peerstate.Job() forms the default process "
    "group itself, again in every epoch, so that it can abort it (choose the backend with Job(backend=...)). "
    "A hot spare could not call it anyway: it has no RANK until track() gives it one.")

SECRET_VARIABLE = "PEERSTATE_SECRET"
KEY_VARIABLE = "PEERSTATE_RANK_KEY"             # the worker's own private key (hex)
JOB_KEY_VARIABLE = "PEERSTATE_JOB_KEY"          # the job's public key (hex)
CERTIFICATE_VARIABLE = "PEERSTATE_CERTIFICATE"  # an initial worker's certificate of its rank (hex)
MIN_SECRET_BYTES = 16


def parse_secret(text: str, source: str = SECRET_VARIABLE) -> bytes:
    """The job secret from its hex form, read from ``source``; InvalidArgumentError
    naming what is wrong with it otherwise."""
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise InvalidArgumentError(f"{source} must be hexadecimal (e.g. the output of "
                                   "`python -c 'import secrets; print(secrets.token_hex(32))'`); "
                                   f"it holds {len(text)} characters that are not") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(f"{source} holds {len(secret)} bytes; the job secret needs at least "
                                   f"{MIN_SECRET_BYTES} (32 hexadecimal digits)")
    return secret


def _hex(env: Mapping[str, str], name: str) -> bytes:
    try:
        return bytes.fromhex(env[name])
    except ValueError:
        raise InvalidArgumentError(f"{name} must be hexadecimal, as this process's agent wrote it: was the "
                                   "environment changed?") from None


def job_secret(nnodes: int, secret_file: Optional[str] = None, env: Mapping[str, str] = os.environ) -> bytes:
    """The job's replication secret, as an agent finds it: PEERSTATE_SECRET, else
    ``secret_file`` (hex; created with mode 0600 if absent on a one-node job), else
    a fresh one for a one-node job. Never from the job's store, which anyone who
    reaches its port can read. InvalidArgumentError names what is missing or wrong.

    Who must be trusted: every holder of the secret (it lets a peer push and pull
    any rank's state), and the store's network (whoever reaches the store can
    disturb the control plane, though it learns no secret there)."""
    if env.get(SECRET_VARIABLE):
        return parse_secret(env[SECRET_VARIABLE])
    if secret_file:
        if not os.path.exists(secret_file):
            if nnodes > 1:
                raise InvalidArgumentError(
                    f"the secret file {secret_file} does not exist: a job of {nnodes} nodes needs the same secret on "
                    "every node; create it once (python -c 'import secrets; print(secrets.token_hex(32))' > FILE; "
                    "chmod 600 FILE) and give it to every agent")
            descriptor = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_hex(32) + "\n")
        mode = os.stat(secret_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidArgumentError(f"the secret file {secret_file} is readable by others (mode "
                                       f"{stat.S_IMODE(mode):o}); chmod 600 it")
        with open(secret_file) as source:
            return parse_secret(source.read().strip(), f"the secret file {secret_file}")
    if nnodes > 1:
        raise InvalidArgumentError(f"a job of {nnodes} nodes needs one secret on every node: set {SECRET_VARIABLE} "
                                   "(hex, at least 16 bytes) or give every agent --secret-file")
    return secrets.token_bytes(32)


@dataclass(frozen=True)
class WorkerEnvironment:
    """One process's place in the job, as its agent started it."""

    store: str                 # the job's store: HOST:PORT of a TCPStore, or etcd://... (open_store)
    worker: str                # n{node}.{k}
    spare: bool                # a hot spare (no rank yet)
    world_size: int
    nproc_per_node: int
    node: int
    host: str = "127.0.0.1"    # the address its replication server listens on
    progress: Optional[str] = None   # its progress counter's file
    events: Optional[str] = None     # the job's event log
    private_key: bytes = b""         # its own key (always set by the agent)
    job_key: bytes = b""             # the job's public key (always set by the agent)
    certificate: Optional[bytes] = None  # an initial worker's, of its rank
    rank: Optional[int] = None       # an initial worker's rank
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    protection: str = "authenticated"  # of the replication frames (Replication's protection)
    node_store: str = ""               # HOST:PORT of its agent's node channel (loopback)

    @property
    def slot(self) -> int:
        """Its index on its node (``n{node}.{slot}``): below nproc_per_node for an
        initial worker, above for a spare."""
        return int(self.worker.rsplit(".", 1)[1])

    def to_env(self) -> Dict[str, str]:
        """The variables to add to the process's environment."""
        env = dict(
            WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.nproc_per_node), GROUP_RANK=str(self.node),
            PEERSTATE_STORE=self.store, PEERSTATE_WORKER=self.worker, PEERSTATE_HOST=self.host,
            PEERSTATE_ROLE="spare" if self.spare else "worker", PEERSTATE_FRAME_PROTECTION=self.protection,
            PEERSTATE_NODE_STORE=self.node_store,
        )
        if not is_etcd(self.store):  # a TCPStore; etcd has no one address to name
            host, _, port = self.store.rpartition(":")
            env.update(MASTER_ADDR=host, MASTER_PORT=port)
        if self.progress:
            env["PEERSTATE_PROGRESS"] = self.progress
        if self.events:
            env["PEERSTATE_EVENTS"] = self.events
        env[KEY_VARIABLE] = self.private_key.hex()
        env[JOB_KEY_VARIABLE] = self.job_key.hex()
        if self.certificate is not None:
            env[CERTIFICATE_VARIABLE] = self.certificate.hex()
        if self.rank is not None:
            env.update(RANK=str(self.rank), LOCAL_RANK=str(self.rank % self.nproc_per_node))
        else:
            env["LOCAL_RANK"] = str(self.slot % self.nproc_per_node)  # provisional (see the module docstring)
        if self.checkpoint_dir:
            env.update(PEERSTATE_CHECKPOINT_DIR=self.checkpoint_dir,
                       PEERSTATE_CHECKPOINT_EVERY=str(self.checkpoint_every))
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "WorkerEnvironment":
        """Read and check this process's variables; InvalidArgumentError naming the
        first that is missing or wrong."""
        if "PEERSTATE_STORE" not in env:
            raise InvalidArgumentError(
                "peerstate.Job() runs in a process started by `peerstate run` (PEERSTATE_STORE is not set); "
                "start the script with: peerstate run --nproc-per-node N --spares S script.py")
        try:
            spare = env.get("PEERSTATE_ROLE", "worker") == "spare"
            result = cls(
                store=env["PEERSTATE_STORE"], worker=env["PEERSTATE_WORKER"], spare=spare,
                world_size=int(env["WORLD_SIZE"]), nproc_per_node=int(env["LOCAL_WORLD_SIZE"]),
                node=int(env.get("GROUP_RANK", env["PEERSTATE_WORKER"][1:].split(".")[0])),
                host=env.get("PEERSTATE_HOST", "127.0.0.1"), progress=env.get("PEERSTATE_PROGRESS"),
                events=env.get("PEERSTATE_EVENTS"),
                private_key=_hex(env, KEY_VARIABLE), job_key=_hex(env, JOB_KEY_VARIABLE),
                certificate=None if spare else _hex(env, CERTIFICATE_VARIABLE),
                rank=None if spare else int(env["RANK"]),
                checkpoint_dir=env.get("PEERSTATE_CHECKPOINT_DIR"),
                checkpoint_every=int(env.get("PEERSTATE_CHECKPOINT_EVERY", "0")),
                protection=env.get("PEERSTATE_FRAME_PROTECTION", "authenticated"),
                node_store=env["PEERSTATE_NODE_STORE"])
            if not is_etcd(result.store):
                int(result.store.rpartition(":")[2])  # HOST:PORT
            int(result.node_store.rpartition(":")[2])
        except InvalidArgumentError:
            raise
        except KeyError as missing:
            raise InvalidArgumentError(f"{missing.args[0]} is not set: this process was not started by "
                                       "`peerstate run`, or its environment was changed") from None
        except ValueError as error:
            raise InvalidArgumentError(f"a peerstate variable of this process is malformed: {error}") from None
        return result

    def credentials(self, rank: int, certificate: Optional[bytes] = None) -> "_C.Credentials":
        """This process's credentials as ``rank``: with its own certificate, or a
        spare's (``certificate``, from the node channel). InvalidArgumentError if
        the certificate is not the job's for this process's key and that rank."""
        from peerstate import _C  # noqa: F811 - the native module, loaded when first needed
        found = certificate if certificate is not None else self.certificate
        if found is None:
            raise InvalidArgumentError(f"{self.worker} has no certificate of rank {rank}: its agent certifies a "
                                       "spare in the node channel when a plan gives it a rank")
        return _C.Credentials(rank, self.private_key, found, self.job_key)

"""A real etcd cluster on 127.0.0.1, for the tests and the benchmarks: ``members``
etcd processes (3.4 or later, from the PATH) with ports the kernel picked free,
each killable with SIGKILL, all stopped by ``close()``; with ``tls``, its client
port speaks HTTPS and asks for client certificates. Not for production: the data
lives in a scratch directory and the election timeout is a loopback one."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from peerstate.errors import InvalidArgumentError

BIND_ATTEMPTS = 3  # starts of a cluster whose member lost a port to another process between its pick and etcd's bind


@dataclass(frozen=True)
class ClusterTls:
    """PEM files of a TLS cluster: its CA, the members' certificate (for 127.0.0.1)
    and key, and a client certificate and key the CA signed."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _die_with_parent() -> None:
    """In the child: SIGKILL when the process that started it dies, so a test process
    killed outright leaves no etcd behind (tools may not import the launcher's own)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_ports(count: int) -> List[int]:
    """``count`` distinct ports free on 127.0.0.1 now. Every probe is held until all are
    picked: one released early could be handed out again, and two members would share
    it. Another process may still take one before etcd binds it (``EtcdCluster`` then
    starts again)."""
    probes: List[socket.socket] = []
    try:
        for _ in range(count):
            probe = socket.socket()
            probes.append(probe)
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


class EtcdCluster:
    def __init__(self, directory: Path, members: int = 1, tls: Optional["ClusterTls"] = None) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise InvalidArgumentError("no etcd binary on the PATH (Debian: apt-get install etcd-server)")
        self.directory = directory
        self.tls = tls
        self._context: Optional[ssl.SSLContext] = None
        if tls:
            self._context = ssl.create_default_context(cafile=tls.ca)
            self._context.load_cert_chain(tls.client_cert, tls.client_key)
        self.processes: List[Optional[subprocess.Popen]] = []
        for attempt in range(BIND_ATTEMPTS):
            self._start(binary, members, tls)
            try:
                self._wait_healthy(timeout=30)
                return
            except BaseException as error:
                self.close()
                lost_port = isinstance(error, RuntimeError) and "address already in use" in str(error)
                if not lost_port or attempt + 1 == BIND_ATTEMPTS:
                    raise

    def _start(self, binary: str, members: int, tls: Optional["ClusterTls"]) -> None:
        """Start ``members`` fresh members on ports free now (a new data directory each)."""
        ports = _free_ports(2 * members)
        self.client_ports, peer_ports = ports[:members], ports[members:]
        initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peer_ports))
        self.processes = []
        for i in range(members):
            shutil.rmtree(self.directory / f"etcd-m{i}", ignore_errors=True)
            client = f"{'https' if tls else 'http'}://127.0.0.1:{self.client_ports[i]}"
            peer = f"http://127.0.0.1:{peer_ports[i]}"
            secured = ["--cert-file", tls.server_cert, "--key-file", tls.server_key, "--client-cert-auth",
                       "--trusted-ca-file", tls.ca] if tls else []
            log = open(self.directory / f"etcd-m{i}.log", "wb")
            self.processes.append(subprocess.Popen(
                [binary, "--name", f"m{i}", "--data-dir", str(self.directory / f"etcd-m{i}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"peerstate-test-{os.getpid()}",
                 # a loopback cluster: elect a new leader within ~0.5 s of losing one
                 "--heartbeat-interval", "50", "--election-timeout", "500", *secured],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent))

    @property
    def endpoints(self) -> List[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        """What ``peerstate run --store`` takes."""
        return ("etcds://" if self.tls else "etcd://") + ",".join(self.endpoints)

    def status(self, member: int) -> dict:
        if self._context:
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                "127.0.0.1", self.client_ports[member], timeout=2, context=self._context)
        else:
            connection = http.client.HTTPConnection("127.0.0.1", self.client_ports[member], timeout=2)
        try:
            connection.request("POST", "/v3/maintenance/status", body="{}")
            return json.loads(connection.getresponse().read())
        finally:
            connection.close()

    def leader(self) -> int:
        """The index of the member that leads now."""
        for i, process in enumerate(self.processes):
            if process is None:
                continue
            status = self.status(i)
            if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return i
        raise RuntimeError("no member leads")

    def kill(self, member: int) -> None:
        process = self.processes[member]
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it exited, and its group with it (a member that could not bind its port)
            process.wait(10)
            self.processes[member] = None

    def close(self) -> None:
        for i in range(len(self.processes)):
            self.kill(i)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self.status(i).get("leader") for i in range(len(self.processes))):
                    return
            except (OSError, ValueError, http.client.HTTPException):
                pass
            exited = [i for i, p in enumerate(self.processes) if p is not None and p.poll() is not None]
            if exited or time.monotonic() > deadline:
                logs = "\n".join((self.directory / f"etcd-m{i}.log").read_text()[-2000:]
                                 for i in range(len(self.processes)))
                why = f"members {exited} exited" if exited else f"etcd did not become healthy within {timeout}s"
                raise RuntimeError(f"{why}:\n{logs}")
            time.sleep(0.05)

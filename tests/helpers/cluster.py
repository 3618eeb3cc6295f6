"""Real processes for multi-rank tests: start tests/helpers/peer.py ranks, drive them
over loopback connections with deadlines, stop/continue/kill them with signals, and
never leave one behind.

Each rank is forked from one fork server per test process (peerstate's own, as a
node's agent uses it), which imported torch and peerstate once: a rank is ready in
a fraction of a second instead of an interpreter's start and torch's import (~2
CPU-seconds, dozens of ranks in the replication tests). Each is its own session;
it dies with the server, and the server with the test process."""

import atexit
import json
import os
import secrets
import selectors
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PEER_SCRIPT = Path(__file__).with_name("peer.py")
PRELOAD = ["torch", "peerstate", "peerstate.replication.stopped_holder"]
_server = None


def _fork_server():
    global _server
    if _server is None or not _server.alive():
        from peerstate.launcher.fork_server import ForkServer

        log = tempfile.NamedTemporaryFile(prefix="peer-fork-server-", suffix=".log", delete=False)
        log.close()
        _server = ForkServer(PRELOAD, os.environ, log.name)
        atexit.register(_server.close)
    return _server


class PeerError(Exception):
    def __init__(self, reply):
        super().__init__(f"{reply['error']}: {reply['message']}")
        self.error = reply["error"]
        self.message = reply["message"]


class Peer:
    def __init__(self, name, timeout=120.0):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"peer-{name}-", suffix=".log", delete=False)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            address = "127.0.0.1:%d" % listener.getsockname()[1]
            self.proc = _fork_server().spawn([str(PEER_SCRIPT), "--connect", address], os.environ, self.log.name)
            listener.settimeout(0.2)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    self._connection, _ = listener.accept()
                    break
                except socket.timeout:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.kill()
                        raise RuntimeError(f"peer {name} did not connect (exit {self.proc.poll()}); log:\n"
                                           f"{self.log_tail()}") from None
        self._connection.settimeout(None)
        self._requests = self._connection.makefile("w", encoding="utf-8")
        self._replies = self._connection.makefile("r", encoding="utf-8")
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._connection, selectors.EVENT_READ)

    def send(self, cmd, **args):
        self._requests.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self._requests.flush()

    def reply(self, timeout=60.0):
        """The next reply line; TimeoutError if none comes in time."""
        if not self._selector.select(timeout):
            raise TimeoutError(f"peer {self.name} did not answer within {timeout}s; log:\n{self.log_tail()}")
        try:
            line = self._replies.readline()
        except ConnectionResetError:  # it died with a request unread: as the end of its output
            line = ""
        if not line:
            raise RuntimeError(f"peer {self.name} exited (code {self.proc.poll()}); log:\n{self.log_tail()}")
        return json.loads(line)

    def ready(self, timeout=0.0):
        return bool(self._selector.select(timeout))

    def call(self, cmd, timeout=60.0, **args):
        self.send(cmd, **args)
        reply = self.reply(timeout)
        if not reply["ok"]:
            raise PeerError(reply)
        return reply

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def alive(self):
        return self.proc.poll() is None

    def log_tail(self, n=4000):
        try:
            return Path(self.log.name).read_text()[-n:]
        except OSError:
            return ""

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()
        self._selector.close()
        for end in (self._requests, self._replies, self._connection):
            try:
                end.close()
            except OSError:  # a write buffered for a peer already gone
                pass
        self.log.close()
        os.unlink(self.log.name)


class Cluster:
    """N ranks wired for replication; a context manager that kills every process on exit."""

    def __init__(self, nodes, k=1, **setup):
        self.nodes = list(nodes)
        self.k = k
        self.secret = secrets.token_hex(32)
        self.setup_args = setup
        self.peers = {}
        self.addresses = {}
        self.sizes = {}

    def __enter__(self):
        try:
            for rank in range(len(self.nodes)):
                self.start(rank)
            for rank in self.peers:
                self.wire(rank)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start(self, rank, name=None, **overrides):
        peer = Peer(name or f"rank{rank}")
        self.peers[name or rank] = peer
        args = dict(self.setup_args, **overrides)
        reply = peer.call("setup", timeout=120, rank=rank, nodes=self.nodes, k=self.k, secret=self.secret, **args)
        if name is None:
            self.addresses[rank] = ["127.0.0.1", reply["port"]]
            self.sizes[rank] = reply["bytes_per_version"]
        return peer

    def wire(self, rank):
        peer = self.peers[rank]
        peer.call("connect", addresses=self.addresses)
        placement_served = [r for r in range(len(self.nodes)) if rank in self.holders(r)]
        peer.call("reserve", sizes={r: self.sizes[r] for r in placement_served})

    def holders(self, rank):
        import warnings

        import peerstate

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return peerstate.BuddyPlacement(self.nodes, k=self.k).holders(rank)

    def __exit__(self, *exc):
        for peer in self.peers.values():
            peer.close()
        return False


def wait_until(predicate, timeout, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()

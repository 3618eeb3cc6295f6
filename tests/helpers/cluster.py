"""Real processes for multi-rank tests: spawn tests/peer.py ranks, drive them over
pipes with deadlines, stop/continue/kill them with signals, and never leave one behind."""

import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEER_SCRIPT = Path(__file__).with_name("peer.py")


class PeerError(Exception):
    def __init__(self, reply):
        super().__init__(f"{reply['error']}: {reply['message']}")
        self.error = reply["error"]
        self.message = reply["message"]


class Peer:
    def __init__(self, name):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"peer-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, bufsize=1, start_new_session=True,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)

    def send(self, cmd, **args):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout=60.0):
        """The next reply line; TimeoutError if none comes in time."""
        if not self._selector.select(timeout):
            raise TimeoutError(f"peer {self.name} did not answer within {timeout}s; log:\n{self.log_tail()}")
        line = self.proc.stdout.readline()
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
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()
        self._selector.close()
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

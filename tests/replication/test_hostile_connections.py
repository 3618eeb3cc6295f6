"""The tcp server against peers that try to take its connections: bounded
connections and threads, deadlines in every phase, no lock-out of an honest
peer by connections that never finish their handshake or by an attacker that
holds every descriptor. Real sockets on 127.0.0.1 (attackers also from lo's
other addresses), a real server (in this process, or in a child process with
a descriptor or thread limit of its own)."""

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import peerstate
from peerstate import _C

from helpers.wire_client import SECRET, authenticate, closed_by_server, credentials


def threads_of_this_process():
    return len(os.listdir("/proc/self/task"))


def test_idle_unauthenticated_connections_get_no_thread_each(rig):
    before = threads_of_this_process()
    socks = [socket.create_connection(rig.address, timeout=5) for _ in range(100)]
    try:
        time.sleep(0.5)
        # One source's share of handshakes (16), and nothing per extra connection: each newcomer closed the oldest.
        assert threads_of_this_process() - before <= 16 + 2
        assert rig.server.stats()["evicted"] >= 100 - 16
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10  # the ones in their handshake are let go at its 5 s deadline at most
    while time.monotonic() < deadline:
        try:
            rig.assert_intact()
            return
        except peerstate.PeerConnectionError:
            time.sleep(0.2)
    rig.assert_intact()


def test_one_peer_cannot_hold_more_than_its_share_of_connections(rig):
    socks = []
    try:
        for _ in range(40):
            sock = socket.create_connection(rig.address, timeout=5)
            authenticate(sock)
            socks.append(sock)
        open_ones = [s for s in socks if not closed_by_server(s, timeout=0.2)]
        assert len(open_ones) <= 16
    finally:
        for s in socks:
            s.close()
    rig.assert_intact()


class Flood:
    """Connections that never finish their handshake (silent, or trickling a byte of
    garbage now and then), opened without pause from the loopback addresses
    127.0.0.2-9 (lo's own; every connection goes to the server on 127.0.0.1), the
    newest 300 kept open, until stopped."""

    def __init__(self, address, trickle):
        self.address, self.trickle = address, trickle
        self.opened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        socks = []
        while not self.stop.is_set():
            try:
                sock = socket.create_connection(self.address, timeout=1,
                                                source_address=(f"127.0.0.{2 + self.opened % 8}", 0))
                socks.append(sock)
                self.opened += 1
            except OSError:
                pass
            if len(socks) > 300:
                socks.pop(0).close()
            if self.trickle:
                for sock in socks[-8:]:
                    try:
                        sock.send(b"\x01")
                    except OSError:
                        pass
        for sock in socks:
            sock.close()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=30)


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling"])
def test_connections_that_never_finish_their_handshake_never_keep_an_honest_peer_out(rig, trickle):
    flood = Flood(rig.address, trickle)
    try:
        while flood.opened < 100:  # the server's handshake table is full before the honest peer comes
            time.sleep(0.05)
        for _ in range(10):
            honest = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1)  # a new connection each time
            honest.add_peer(1, *rig.address)
            try:
                assert honest.describe(1, 0, -1)["version"] == 1
            finally:
                honest.abort()
        opened = flood.opened
    finally:
        flood.close()
    assert opened > 100 and rig.server.stats()["evicted"] > 0
    rig.assert_intact()


@pytest.mark.parametrize("sent", [b"", b"\0" * 39], ids=["idle", "39 of 40 header bytes"])
def test_an_authenticated_connection_that_stops_talking_is_closed(rig, sent):
    with rig.connect() as sock:
        authenticate(sock)
        sock.sendall(sent)
        assert closed_by_server(sock, timeout=10.0)  # the rig's io timeout is 1 s; without one it stays open
    rig.assert_intact()


SERVER_WITH_FEW_DESCRIPTORS = textwrap.dedent("""
    import os, resource, sys, time
    from peerstate import _C
    replicas = _C.ReplicaStore()
    credentials = _C.JobAuthority(bytes.fromhex(sys.argv[1])).issue(1)
    server = _C.TcpServer(replicas, None, credentials=credentials, io_timeout_ms=2000)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 6, used + 6))
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()
""")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def server_with_few_descriptors(tmp_path):
    """(port, log, pid) of a server in a child process left 6 descriptors; stopped at the end."""
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen([sys.executable, "-c", SERVER_WITH_FEW_DESCRIPTORS, SECRET.hex()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        yield int(server.stdout.readline()), log, server.pid
    finally:
        server.stdin.close()
        server.wait(timeout=10)
        log.close()


def served(port):
    """Whether a new connection from an honest peer is served (it holds nothing, and says so)."""
    transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1)
    transport.add_peer(1, "127.0.0.1", port)
    try:
        transport.describe(1, 0, -1)
    except peerstate.NotFoundError:
        return True
    finally:
        transport.abort()
    return False


def test_running_out_of_descriptors_backs_off_instead_of_spinning(server_with_few_descriptors):
    port, log, pid = server_with_few_descriptors
    socks = []
    try:
        for _ in range(30):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        time.sleep(0.5)
        start = cpu_seconds(pid)
        time.sleep(2.0)
        assert cpu_seconds(pid) - start < 0.5  # a retry loop without a pause burns a core
        log.flush()
        assert log.tell() < 20_000, "the server's log is flooded"
    finally:
        for s in socks:
            s.close()
    time.sleep(1.5)  # the backoff is at most a second
    assert served(port)


def test_an_honest_peer_is_served_while_an_attacker_holds_every_descriptor(server_with_few_descriptors):
    port, _, _ = server_with_few_descriptors
    socks = []
    try:
        for _ in range(30):  # more than the server has descriptors: the rest wait in its backlog
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2, source_address=("127.0.0.2", 0)))
        assert served(port)  # while every silent socket is still open here
    finally:
        for s in socks:
            s.close()


SERVER_WITH_FEW_THREADS = textwrap.dedent("""
    import os, resource, sys, time
    from peerstate import _C
    replicas = _C.ReplicaStore()
    credentials = _C.JobAuthority(bytes.fromhex(sys.argv[1])).issue(1)
    server = _C.TcpServer(replicas, None, credentials=credentials, io_timeout_ms=3000)
    os.setgid(65534)  # nobody: root is not held to RLIMIT_NPROC, a user is
    os.setuid(65534)
    threads = len(os.listdir("/proc/self/task"))
    resource.setrlimit(resource.RLIMIT_NPROC, (threads + 2, threads + 2))
    print(server.port, flush=True)
    sys.stdin.read()
    print(server.stats(), flush=True)
    server.stop()
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="the test drops the server's process to user nobody, which needs root")
def test_a_thread_that_cannot_be_created_refuses_the_connection_not_the_process(tmp_path):
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen([sys.executable, "-c", SERVER_WITH_FEW_THREADS, SECRET.hex()], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, text=True)
    socks = []
    try:
        port = int(server.stdout.readline())
        for _ in range(10):  # two get a thread; the others find none
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        time.sleep(0.5)
        assert server.poll() is None, "the server's process died"
        for s in socks:
            s.close()
        server.stdin.close()
        stats = server.stdout.readline()
        assert server.wait(timeout=10) == 0
        log.seek(0)
        assert "no thread to serve it" in log.read()
        assert "'refused': 0" not in stats, stats
    finally:
        for s in socks:
            s.close()
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()

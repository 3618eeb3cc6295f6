"""The tcp transport under hostile input: wrong secrets, garbage, truncated frames,
lying lengths and chunk indices, and a bounded fuzz loop. Every one must end in a
closed connection (and a log line) while the server keeps serving and no byte of
its committed state changes."""

import hashlib
import hmac
import os
import random
import secrets
import socket
import struct
import time

import pytest

import peerstate
from peerstate import _C, _probes

from helpers.wire_client import (ACK, ERROR, GET_CHUNK, GET_META, PUT_BEGIN, PUT_CHUNK, PUT_COMMIT, credentials,
                                 authenticate, closed_by_server, frame, recv_exact)

def test_native_hmac_matches_python():
    for key, msg in [(b"k" * 16, b""), (b"key", b"The quick brown fox"), (b"x" * 100, os.urandom(1000))]:
        assert _probes.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()
    # RFC 4231 test case 2
    assert _probes.hmac_sha256(b"Jefe", b"what do ya want for nothing?").hex() == (
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")


def test_the_frame_protections_pass_is_measured_through_the_transports_libcrypto():
    # What bench/replication.py's ceiling is made of: a rate, never zero, and a clear error.
    assert _probes.frame_protection_throughput("authenticated", 1 << 20, 1) > 0
    assert _probes.frame_protection_throughput("encrypted", 1 << 20, 1) > 0
    with pytest.raises(peerstate.InvalidArgumentError, match="'authenticated' or 'encrypted'"):
        _probes.frame_protection_throughput("trusted-fabric", 1 << 20, 1)


def test_short_secret_forged_credentials_and_wildcard_address_must_be_explicit():
    replicas = _C.ReplicaStore()
    with pytest.raises(peerstate.InvalidArgumentError, match="at least 16 bytes"):
        _C.JobAuthority(b"short")
    own = credentials(0)
    # A certificate moved to another rank, or to another key, is refused before anything listens.
    with pytest.raises(peerstate.InvalidArgumentError, match="does not certify this private key as rank 1"):
        _C.Credentials(1, own.private_key, own.certificate, own.job_key)
    with pytest.raises(peerstate.InvalidArgumentError, match="does not certify"):
        _C.Credentials(0, secrets.token_bytes(32), own.certificate, own.job_key)
    with pytest.raises(peerstate.InvalidArgumentError, match="certificate must be 64 bytes"):
        _C.Credentials(0, own.private_key, own.certificate[:10], own.job_key)
    server = _C.TcpServer(replicas, None, credentials=credentials(0))  # default: loopback only
    try:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", server.port), timeout=1).close()  # not bound there
    finally:
        server.stop()


def test_wrong_secret_is_refused_both_ways(rig, capfd):
    other_job = _C.JobAuthority(secrets.token_bytes(32))
    intruder = _C.TcpTransport(credentials=other_job.issue(0), connections_per_peer=1)
    intruder.add_peer(1, *rig.address)
    with pytest.raises(peerstate.AuthenticationError, match="not certified by the same job secret"):
        intruder.describe(1, 0, -1)
    # A server that does not know the secret is refused by an honest client too.
    impostor = _C.TcpServer(_C.ReplicaStore(), None, credentials=other_job.issue(1))
    honest = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1)
    honest.add_peer(1, "127.0.0.1", impostor.port)
    with pytest.raises(peerstate.AuthenticationError):
        honest.describe(1, 0, -1)
    impostor.stop()
    assert rig.server.stats()["rejected"] >= 1
    assert "[peerstate] closing connection" in capfd.readouterr().err
    rig.assert_intact()


@pytest.mark.parametrize("payload", [b"", os.urandom(7), os.urandom(68), os.urandom(4096)], ids=["silent", "7", "68", "4096"])
def test_garbage_instead_of_a_handshake(rig, payload):
    with rig.connect() as sock:
        recv_exact(sock, 40)
        sock.sendall(payload)
        assert closed_by_server(sock)
    rig.assert_intact()


def test_frames_that_close_the_connection(rig):
    meta = rig.valid_meta_bytes()
    get_newest = frame(GET_META, status=1)
    cases = {  # each builds, from the connection's session, what is sent after the handshake
        "bad magic": lambda s: s.frame(frame(GET_META, magic=0xDEADBEEF)),
        "unknown type": lambda s: s.frame(frame(77)),
        "server-only type": lambda s: s.frame(frame(ACK)),
        "oversized metadata": lambda s: frame(PUT_BEGIN, length=(64 << 20) + 1),
        "metadata over the reservation's bound": lambda s: frame(PUT_BEGIN, length=(2 << 20) + 1),
        "truncated header": lambda s: frame(GET_META)[:20],
        "truncated metadata": lambda s: frame(PUT_BEGIN, version=100, length=len(meta)) + meta[: len(meta) // 2],
        "lying buffer count": lambda s: s.frame(frame(PUT_BEGIN, version=100, length=24),
                                                struct.pack("<iqQI", 0, 100, 65536, 10**9)),
        "another rank's state": lambda s: s.frame(frame(PUT_BEGIN, version=100, length=len(meta)),
                                                  rig.valid_meta_bytes(rank=5)),
        "chunk without begin": lambda s: frame(PUT_CHUNK, version=555, chunk=0, length=64),
        "request with payload": lambda s: frame(GET_META, length=8) + b"12345678",
        "negative version without asking for the newest": lambda s: s.frame(frame(GET_META, version=-1)),
        "no tag": lambda s: get_newest + b"\0" * 16,
        "altered header": lambda s: (lambda f: f[:16] + bytes([f[16] ^ 1]) + f[17:])(s.frame(get_newest)),
        "replayed frame": lambda s: (lambda f: f + f)(s.frame(get_newest)),
    }
    before = rig.server.stats()["rejected"]
    for name, build in cases.items():
        with rig.connect() as sock:
            session = authenticate(sock)
            sock.sendall(build(session))
            if name.startswith("truncated"):
                sock.shutdown(socket.SHUT_WR)
            assert closed_by_server(sock), name
    assert rig.server.stats()["rejected"] > before
    rig.assert_intact()


def test_lying_chunk_index_and_length_after_a_valid_begin(rig):
    meta = rig.valid_meta_bytes(version=100)
    chunks = rig.meta["chunks"]
    for chunk, length in [(len(chunks), chunks[0][1]), (10**6, 16), (0, chunks[0][1] + 1), (0, 1 << 40)]:
        with rig.connect() as sock:
            session = authenticate(sock)
            session.send(frame(PUT_BEGIN, version=100, length=len(meta)), meta)
            assert session.recv()[0][1] == ACK
            sock.sendall(frame(PUT_CHUNK, version=100, chunk=chunk, length=length) + b"\xff" * min(length, 1 << 16))
            assert closed_by_server(sock), (chunk, length)
    rig.assert_intact()


def test_errors_that_keep_the_connection(rig):
    with rig.connect() as sock:
        session = authenticate(sock)
        session.send(frame(GET_CHUNK, source_rank=0, version=1, chunk=10**6))
        reply, message = session.recv()
        assert reply[1] == ERROR and b"out of range" in message
        session.send(frame(GET_META, source_rank=42, status=1))
        reply, message = session.recv()
        assert reply[1] == ERROR and b"rank 42" in message
        # A commit whose chunks never came fails after the io timeout; nothing becomes visible.
        meta = rig.valid_meta_bytes(version=100)
        session.send(frame(PUT_BEGIN, version=100, length=len(meta)), meta)
        assert session.recv()[0][1] == ACK
        session.send(frame(PUT_COMMIT, version=100))
        reply, message = session.recv()
        assert reply[1] == ERROR and b"chunks arrived" in message
    rig.assert_intact()


def test_corrupted_chunk_never_commits(rig):
    meta = rig.valid_meta_bytes(version=100)
    raw = bytes(rig.source_store.stored_bytes(1))
    with rig.connect() as sock:
        session = authenticate(sock)
        session.send(frame(PUT_BEGIN, version=100, length=len(meta)), meta)
        assert session.recv()[0][1] == ACK
        for c, (offset, nbytes, _) in enumerate(rig.meta["chunks"]):
            payload = bytearray(raw[offset : offset + nbytes])
            if c == 1:
                payload[5] ^= 0x10  # one bit flipped before it was sealed: the CRC32C catches it
            session.send(frame(PUT_CHUNK, version=100, chunk=c, length=nbytes), bytes(payload))
        session.send(frame(PUT_COMMIT, version=100))
        reply, message = session.recv()
        assert reply[1] == ERROR and b"chunk 1 arrived corrupt" in message
    rig.assert_intact()


def test_fuzz_mutated_frames(rig):
    """A bounded fuzz loop over authenticated connections: valid begin+chunk
    sequences, sealed for the connection, with random bytes flipped, truncated or
    extended. No commit is ever sent, so nothing may become visible."""
    rng = random.Random(int(os.environ.get("PEERSTATE_TEST_SEED", "1234")))
    meta = rig.valid_meta_bytes(version=100)
    raw = bytes(rig.source_store.stored_bytes(1))
    offset, nbytes, _ = rig.meta["chunks"][0]
    deadline = time.monotonic() + 15
    iterations = 0
    while iterations < 200 and time.monotonic() < deadline:
        with rig.connect() as sock:
            session = authenticate(sock)
            data = bytearray(session.frame(frame(PUT_BEGIN, version=100, length=len(meta)), meta) +
                             session.frame(frame(PUT_CHUNK, version=100, chunk=0, length=nbytes),
                                           raw[offset : offset + nbytes]))
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(0, min(len(data), 4096))] = rng.randrange(256)  # headers and metadata
            if rng.random() < 0.3:
                data = data[: rng.randrange(1, len(data))]
            try:
                sock.sendall(bytes(data))
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # closed on us mid-send: that is a rejection too
            assert closed_by_server(sock)
        iterations += 1
    assert iterations >= 50
    rig.assert_intact()


class SilentServer:
    """Accepts connections and never says a word: a hung peer."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]

    def close(self):
        self.sock.close()


def test_timeout_on_a_hung_peer():
    silent = SilentServer()
    transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1, connect_timeout_ms=300)
    transport.add_peer(1, "127.0.0.1", silent.port)
    start = time.monotonic()
    with pytest.raises(peerstate.TimeoutError, match="timed out"):
        transport.describe(1, 0, -1)
    assert time.monotonic() - start < 5
    silent.close()


def test_abort_fails_pending_calls_promptly():
    import threading

    silent = SilentServer()
    transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=2, connect_timeout_ms=60_000)
    transport.add_peer(1, "127.0.0.1", silent.port)
    errors = []

    def blocked_call():
        try:
            transport.describe(1, 0, -1)
        except peerstate.Error as e:
            errors.append(e)

    threads = [threading.Thread(target=blocked_call) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # all three are waiting on the silent peer
    start = time.monotonic()
    transport.abort()
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - start < 30 and not any(t.is_alive() for t in threads)  # the connect timeout is 60 s
    assert len(errors) == 3 and all(isinstance(e, peerstate.AbortedError) for e in errors), errors
    with pytest.raises(peerstate.AbortedError):
        transport.describe(1, 0, -1)  # and every later call
    silent.close()


def test_unreachable_peer_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1)
        transport.add_peer(1, "127.0.0.1", port)
        with pytest.raises(peerstate.PeerConnectionError, match="cannot connect"):
            transport.describe(1, 0, -1)


def test_the_version_before_the_newest_stays_readable_until_its_memory_is_reused(rig):
    replicator = _C.Replicator(rig.source_store.native, rig.transport, 0)
    for tensor in rig.source_state.values():
        tensor.add_(1)
    rig.source_store.snapshot(2).wait()
    replicator.replicate(2, [1])
    assert replicator.wait(2) == [(1, None)]
    assert rig.replicas.committed() == [(0, 2), (0, 1)]
    assert rig.transport.describe(1, 0, 1)["version"] == 1  # still served
    assert rig.transport.describe(1, 0, 2)["version"] == 2
    for tensor in rig.source_state.values():
        tensor.add_(1)
    rig.source_store.snapshot(3).wait()
    replicator.replicate(3, [1])
    assert replicator.wait(3) == [(1, None)]
    assert rig.replicas.committed() == [(0, 3), (0, 2)]  # version 1's memory now holds 3
    with pytest.raises(peerstate.NotFoundError, match="version 1 of rank 0 is not committed here"):
        rig.transport.describe(1, 0, 1)

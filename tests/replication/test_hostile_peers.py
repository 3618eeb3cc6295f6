"""The tcp server against peers that try to forge or stall state: frames a
relay cannot inject or alter, memory within the reservation, versions and
commits a member cannot poison, and reads and writes that never tear a version
nor hold up its owner. Real sockets on 127.0.0.1, a real server in this
process. (Attacks on the connections themselves: test_hostile_connections.py.)"""

import os
import socket
import struct
import threading
import time

import pytest
import torch

import peerstate
from peerstate import _C, _probes

from helpers.listener import stop_accepting
from helpers.wire_client import (ACK, CLIENT_HANDSHAKE_BYTES, ERROR, GET_CHUNK, HEADER, PUT_BEGIN, PUT_CHUNK,
                                 PUT_COMMIT, authenticate, credentials, closed_by_server, frame, meta_bytes, recv_exact)


def rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def forge_first_checksum(meta, chunk_bytes_forged):
    """The version metadata with chunk 0's CRC32C replaced by that of zeros."""
    meta = bytearray(meta)
    at = 4 + 8 + 8
    (count,) = struct.unpack_from("<I", meta, at)
    at += 4
    for _ in range(count):
        (name,) = struct.unpack_from("<H", meta, at)
        at += 2 + name + 8 + 4
        (dtype,) = struct.unpack_from("<H", meta, at)
        at += 2 + dtype
    struct.pack_into("<I", meta, at + 4, _probes.crc32c(bytes(chunk_bytes_forged)))
    return bytes(meta)


class Relay:
    """A man in the middle between a real client and the server: forwards both
    ways, and may forge the client's version: chunk 0's payload zeroed, with its
    CRC32C fixed to match in the frame and in the version's metadata."""

    def __init__(self, target, protection, rewrite=True):
        self.target, self.protection, self.rewrite = target, protection, rewrite
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self.rewritten = 0  # chunks
        self.forged = 0     # metadata
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()

    def _pipe(self, source, sink, from_client):
        try:
            if from_client:  # the handshake's client part, as is
                sink.sendall(recv_exact(source, CLIENT_HANDSHAKE_BYTES))
            tag = 0 if self.protection == "trusted-fabric" else 16
            while True:
                if not from_client:
                    data = source.recv(65536)
                    if not data:
                        break
                    sink.sendall(data)
                    continue
                header = bytearray(recv_exact(source, HEADER.size))
                fields = HEADER.unpack(header)
                payload = recv_exact(source, fields[6]) + recv_exact(source, tag)
                self.seen += payload
                if fields[1] == PUT_BEGIN and self.rewrite:
                    payload = forge_first_checksum(payload[:fields[6]], 64 * 1024) + payload[fields[6]:]
                    self.forged += 1
                if fields[1] == PUT_CHUNK and self.rewrite and not self.rewritten:
                    forged = bytes(fields[6])
                    header[32:36] = struct.pack("<I", _probes.crc32c(forged))
                    payload = forged + payload[fields[6]:]
                    self.rewritten += 1
                sink.sendall(bytes(header) + payload)
        except (OSError, ConnectionError):
            pass
        finally:
            for end in (source, sink):  # shutdown, not only close: it wakes the other pipe's recv
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                end.close()

    def close(self):
        stop_accepting(self.listener, self._acceptor)


def push_through_relay(protection, rewrite=True):
    """Version 2 of a one-tensor rank 0, pushed through a Relay to rank 1's server."""
    source = peerstate.SnapshotStore(chunk_bytes=64 * 1024)
    state = torch.arange(200_000, dtype=torch.float32)
    source.register("w", state)
    source.snapshot(1).wait()
    replicas = _C.ReplicaStore(budget_bytes=16 << 20)
    replicas.reserve(0, source.memory()["bytes_per_version"])
    server = _C.TcpServer(replicas, None, credentials=credentials(1), protection=protection)
    relay = Relay(("127.0.0.1", server.port), protection, rewrite)
    transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1, protection=protection)
    transport.add_peer(1, "127.0.0.1", relay.port)
    replicator = _C.Replicator(source.native, transport, 0)
    replicator.replicate(1, [1])
    [(_, error)] = replicator.wait(1)
    committed, held = replicas.committed(), (replicas.stored_bytes(0) if replicas.committed() else None)
    expected = bytes(source.stored_bytes(1))
    transport.abort()
    relay.close()
    server.stop()
    source.close()
    return error, committed, held, expected, relay


def test_a_relay_that_rewrites_a_chunk_with_a_matching_crc_is_caught():
    error, committed, _, _, relay = push_through_relay("authenticated")
    assert relay.forged == 1
    assert committed == [] and error is not None  # the forged metadata failed its tag: nothing committed


def test_without_frame_protection_the_same_relay_forges_the_replica():
    # The opt-out is real, and the relay above is a real forgery: with trusted-fabric it lands.
    error, committed, held, expected, relay = push_through_relay("trusted-fabric")
    assert relay.forged == 1 and relay.rewritten == 1 and error is None and committed == [(0, 1)]
    assert held != expected


@pytest.mark.parametrize("protection", ["authenticated", "encrypted"])
def test_encrypted_frames_hide_the_state_and_both_modes_deliver_it(protection):
    error, committed, held, expected, relay = push_through_relay(protection, rewrite=False)
    assert error is None and committed == [(0, 1)] and held == expected
    sample = expected[4096:4160]  # 16 floats of the arange, as they travel in clear
    assert (sample in relay.seen) == (protection == "authenticated")


def test_a_protection_mismatch_fails_the_handshake_and_says_so(rig):
    other = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1, protection="encrypted")
    other.add_peer(1, *rig.address)
    with pytest.raises(peerstate.AuthenticationError):
        other.describe(1, 0, -1)
    rig.assert_intact()


def test_a_stalled_push_is_cut_by_the_next_and_nothing_is_allocated_past_two_regions(rig):
    offset, nbytes, _ = rig.meta["chunks"][0]
    page = os.sysconf("SC_PAGE_SIZE")
    reservation = -(-rig.source_store.memory()["bytes_per_version"] // page) * page  # regions are whole pages
    stalled = []
    try:
        for i in range(24):
            sock = rig.connect()
            session = authenticate(sock)
            meta = rig.valid_meta_bytes(version=100 + i)
            session.send(frame(PUT_BEGIN, version=100 + i, length=len(meta)), meta)
            reply, message = session.recv()
            assert reply[1] == ACK, message  # the stalled push before it held a region: it was cut
            # Half a chunk, then silence: the writer holds the version's region.
            sock.sendall(frame(PUT_CHUNK, version=100 + i, chunk=0, length=nbytes) + b"\0" * (nbytes // 2))
            stalled.append(sock)
            assert rig.replicas.held_bytes() <= 2 * reservation
        assert all(closed_by_server(s) for s in stalled[:-1])
    finally:
        for s in stalled:
            s.close()
    time.sleep(0.3)
    rig.assert_intact()


def test_a_stuck_reader_or_a_stalled_writer_never_keeps_a_ranks_next_version_out():
    # Two regions per source: the committed version's and one more. A reader of the
    # version before (one 32 MiB chunk, more than the socket buffers hold) that reads
    # nothing holds that one; so does a writer that stalls half way through a chunk.
    # The rank's next real push cuts either, instead of being refused as busy until
    # the server's io timeout (60 s) ends the holder.
    state = torch.zeros(8 << 20)
    source = peerstate.SnapshotStore(chunk_bytes=32 << 20)
    source.register("state", state)
    replicas = _C.ReplicaStore(budget_bytes=1 << 30)
    replicas.reserve(0, source.memory()["bytes_per_version"])
    server = _C.TcpServer(replicas, None, credentials=credentials(1), io_timeout_ms=60_000)
    transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=2, io_timeout_ms=60_000)
    transport.add_peer(1, "127.0.0.1", server.port)
    replicator = _C.Replicator(source.native, transport, 0)

    def push(version):
        state.fill_(version)
        source.snapshot(version).wait()
        replicator.replicate(version, [1])
        return replicator.wait(version)

    holders = []
    try:
        assert push(1) == [(1, None)] and push(2) == [(1, None)]  # 2 committed, 1 still readable
        reader = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        holders.append(reader)
        reading = authenticate(reader, rank=2)
        reading.send(frame(GET_CHUNK, source_rank=0, version=1, chunk=0))
        reader.recv(1, socket.MSG_PEEK)  # the send has begun: version 1's region is held
        assert push(3) == [(1, None)]
        with pytest.raises(ConnectionError):
            reading.recv()  # cut mid-frame: never a whole chunk of another version

        source.snapshot(4).wait()
        writer = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        holders.append(writer)
        writing = authenticate(writer, rank=0)
        meta = meta_bytes(source.version_info(4), 4, 0, 32 << 20)
        writing.send(frame(PUT_BEGIN, version=4, length=len(meta)), meta)
        assert writing.recv()[0][1] == ACK
        writer.sendall(frame(PUT_CHUNK, version=4, chunk=0, length=32 << 20) + b"\0" * (16 << 20))  # then nothing
        assert push(5) == [(1, None)]
        assert replicas.committed()[0] == (0, 5)
        assert replicas.stored_bytes(0) == bytes(source.stored_bytes(5))
        assert closed_by_server(writer)
    finally:
        for sock in holders:
            sock.close()
        transport.abort()
        server.stop()
        source.close()


def test_metadata_announced_within_the_bound_holds_memory_only_as_it_arrives(rig):
    # Each connection announces the most metadata a rank may send (the 1 MiB floor) and
    # sends none of it: 256 connections, the server's cap, 16 (the per-rank cap) from each
    # of 16 certified ranks. The server waits for the bytes (a 10 s io timeout, so none is
    # let go while this measures): what it holds meanwhile must follow what arrived, a
    # 64 KiB piece per connection (16 MiB), not what was announced (256 MiB), and stay
    # within the replica budget (64 MiB).
    server = _C.TcpServer(rig.replicas, rig.own_store.native, credentials=credentials(1), io_timeout_ms=10_000)
    socks = []
    try:
        before = rss_bytes()
        for rank in range(16):
            member = credentials(rank)
            for _ in range(16):
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                socks.append(sock)
                authenticate(sock, own=member)
                sock.sendall(frame(PUT_BEGIN, source_rank=rank, version=100, length=1 << 20))  # then nothing
        deadline = time.monotonic() + 30
        while server.stats()["active"] < len(socks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["active"] == len(socks)
        time.sleep(0.3)  # every connection's thread has read its header and waits for the metadata
        held = rss_bytes() - before
        assert held < 64 << 20, f"{held >> 20} MiB held for 256 announcements of 1 MiB, over the replica budget"
    finally:
        for s in socks:
            s.close()
        server.stop()
    rig.assert_intact()


@pytest.mark.parametrize("version,why", [(2**63 - 1, b"ahead of the committed version"),
                                         (1 + (1 << 16) + 1, b"ahead of the committed version"),
                                         (1, b"not newer"), (-5, b"negative")])
def test_a_member_cannot_poison_its_replica_by_version_number(rig, version, why):
    meta = rig.valid_meta_bytes(version=version)
    with rig.connect() as sock:
        session = authenticate(sock)
        session.send(frame(PUT_BEGIN, version=version, length=len(meta)), meta)
        reply, message = session.recv()
        assert reply[1] == ERROR and why in message, message
    rig.assert_intact()
    # ...and the rank's next real version still lands.
    replicator = _C.Replicator(rig.source_store.native, rig.transport, 0)
    rig.source_store.snapshot(2).wait()
    replicator.replicate(2, [1])
    assert replicator.wait(2) == [(1, None)]


def put_begin(rig, meta, version):
    """The server's answer to a PUT_BEGIN of ``meta`` as ``version``: (ERROR or ACK, message)."""
    with rig.connect() as sock:
        session = authenticate(sock)
        session.send(frame(PUT_BEGIN, version=version, length=len(meta)), meta)
        reply, message = session.recv()
        return reply[1], message


def test_a_member_cannot_ratchet_a_replica_with_empty_versions(rig):
    # A version number with no state (an empty layout) commits with no chunk sent: 200 of
    # them once moved a replica 13 million versions ahead in 0.03 s, and the real rank's
    # next push was refused as not newer. Rank 0 reserved bytes: it has state to send.
    empty = struct.pack("<iqQI", 0, 2, 64 * 1024, 0) + struct.pack("<I", 0)
    kind, message = put_begin(rig, empty, 2)
    assert kind == ERROR and b"empty layout" in message, message
    rig.assert_intact()


def test_versions_are_bounded_by_the_job_not_the_sender_even_with_nothing_committed(rig):
    # The holder has reached step 0 again (a roll-back cleared its replicas): it commits
    # nothing, and takes no version past its step plus the window, INT64_MAX included.
    rig.replicas.drop_newer(0)
    rig.replicas.bound_versions(64)
    assert rig.replicas.committed() == []
    for version in (2**63 - 1, 2**40, 65):
        kind, message = put_begin(rig, rig.valid_meta_bytes(version=version), version)
        assert kind == ERROR and b"ahead of what this job has reached" in message, (version, message)
    assert put_begin(rig, rig.valid_meta_bytes(version=64), 64)[0] == ACK


def test_a_chunk_sent_again_after_it_landed_cannot_touch_the_committed_replica(rig):
    raw = bytes(rig.source_store.stored_bytes(1))
    meta = rig.valid_meta_bytes(version=2)
    chunks = rig.meta["chunks"]
    with rig.connect() as a, rig.connect() as b:
        first = authenticate(a)
        authenticate(b)  # the second connection sends raw bytes: it never gets to its tag
        first.send(frame(PUT_BEGIN, version=2, length=len(meta)), meta)
        assert first.recv()[0][1] == ACK
        for c, (offset, nbytes, _) in enumerate(chunks):
            first.send(frame(PUT_CHUNK, version=2, chunk=c, length=nbytes, crc=0), raw[offset:offset + nbytes])
        time.sleep(0.3)  # every chunk of the first connection has landed (nothing acknowledges a chunk)
        # The same chunk again, from another connection, half of it before the commit.
        offset, nbytes, _ = chunks[0]
        b.sendall(frame(PUT_CHUNK, version=2, chunk=0, length=nbytes) + b"\xee" * (nbytes // 2))
        first.send(frame(PUT_COMMIT, version=2))
        reply, _ = first.recv()
        assert reply[1] == ACK
        try:
            b.sendall(b"\xee" * (nbytes - nbytes // 2))
        except OSError:
            pass
        assert closed_by_server(b)
    time.sleep(0.2)
    assert rig.replicas.committed()[0] == (0, 2)
    assert rig.replicas.stored_bytes(0) == raw  # version 2 carries version 1's bytes, untouched


@pytest.fixture
def stuck_reader():
    """(store, state, session): an owner's store holding versions 7 and 8, and a reader
    that asked the owner's server for version 7's one chunk (32 MiB, more than the
    socket buffers hold) and reads none of it: the server is blocked mid-send, pinning
    version 7, until its io timeout (60 s) unless the owner cuts it."""
    store = peerstate.SnapshotStore(max_versions=2, chunk_bytes=32 << 20)
    state = torch.zeros(8 << 20)
    store.register("own", state)
    store.snapshot(7).wait()
    state.fill_(1.0)
    store.snapshot(8).wait()
    server = _C.TcpServer(_C.ReplicaStore(), store.native, credentials=credentials(1), io_timeout_ms=60_000)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        session = authenticate(sock)
        session.send(frame(GET_CHUNK, source_rank=1, version=7, chunk=0))
        sock.recv(1, socket.MSG_PEEK)  # the send has begun: the pin is held
        yield store, state, session
    finally:
        sock.close()
        server.stop()
        store.close()


def test_a_stuck_reader_of_the_own_snapshot_is_cut_and_never_holds_up_the_next_snapshot(stuck_reader):
    store, state, session = stuck_reader
    state.fill_(2.0)
    snapshot = threading.Thread(target=lambda: store.snapshot(9).wait())
    snapshot.start()  # needs version 7's slot
    snapshot.join(timeout=30)
    assert not snapshot.is_alive(), "the owner's snapshot waited for a reader that reads nothing"
    assert store.committed_versions() == [8, 9]
    with pytest.raises(ConnectionError):
        session.recv()  # the frame was cut: the reader never gets bytes of two versions as one


def test_close_cuts_a_stuck_reader_instead_of_waiting_for_it(stuck_reader):
    store, _, session = stuck_reader
    closing = threading.Thread(target=store.close)
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive(), "close() waited for a reader that reads nothing"
    with pytest.raises(ConnectionError):
        session.recv()

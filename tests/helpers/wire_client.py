"""An independent client of the tcp transport's wire format (handshake and
AES-256-GCM frames, written from the description in csrc/net/wire.h and
csrc/net/credentials.h with Python's hmac and the cryptography package), and ``Rig``: a real holder with
state to keep intact, for the tests of hostile peers."""

import hashlib
import hmac
import secrets
import socket
import struct

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import peerstate
from peerstate import _C

SECRET = secrets.token_bytes(32)
AUTHORITY = _C.JobAuthority(SECRET)  # what every agent of this job derives from SECRET


def credentials(rank):
    """Fresh credentials of ``rank`` in this job, as an agent issues them."""
    return AUTHORITY.issue(rank)

HEADER = struct.Struct("<IHHiIqQII")
MAGIC = 0x31765350
PUT_BEGIN, PUT_CHUNK, PUT_COMMIT, GET_META, GET_CHUNK, META, CHUNK, ACK, ERROR = range(1, 10)


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed")
        data += part
    return data


PROTECTIONS = {"authenticated": 1, "encrypted": 2, "trusted-fabric": 3}
CERTIFICATE_BYTES = 4 + 32 + 64  # rank, its public key, the job's signature
CLIENT_HANDSHAKE_BYTES = 32 + 1 + CERTIFICATE_BYTES + 64  # share, protection, certificate, signature


class Session:
    """A connection's frames after the handshake, sealed and opened as the wire
    format describes (AES-256-GCM over header and payload, a nonce that counts the
    frames of each direction), with the ``cryptography`` package: an independent
    check of the native implementation."""

    def __init__(self, sock, protection, to_server, to_client):
        self.sock, self.protection = sock, protection
        self.seal = AESGCM(to_server) if protection != "trusted-fabric" else None
        self.open = AESGCM(to_client) if protection != "trusted-fabric" else None
        self.sent = self.received = 0

    @staticmethod
    def nonce(counter):
        return b"\0" * 4 + struct.pack("<Q", counter)

    def frame(self, header, payload=b""):
        """The bytes of one frame: header, payload and tag."""
        if self.seal is None:
            return header + payload
        nonce = self.nonce(self.sent)
        self.sent += 1
        if self.protection == "encrypted":
            sealed = self.seal.encrypt(nonce, payload, header)
            return header + sealed
        return header + payload + self.seal.encrypt(nonce, b"", header + payload)

    def send(self, header, payload=b""):
        self.sock.sendall(self.frame(header, payload))

    def recv(self):
        """(header fields, payload) of the next frame from the server, its tag checked."""
        header = recv_exact(self.sock, HEADER.size)
        fields = HEADER.unpack(header)
        payload = recv_exact(self.sock, fields[6])
        if self.open is not None:
            nonce = self.nonce(self.received)
            self.received += 1
            tag = recv_exact(self.sock, 16)
            if self.protection == "encrypted":
                payload = self.open.decrypt(nonce, payload + tag, header)
            else:
                self.open.decrypt(nonce, tag, header + payload)
        return fields, payload


def authenticate(sock, rank=0, protection="authenticated", own=None, claim=None):
    """The client side of the handshake as ``rank`` (or with the credentials ``own``),
    written from the protocol description with the cryptography package: an
    independent check of the native implementation. ``claim``: the rank written
    into the certificate shown, when it differs from the one certified (a forgery).
    Returns the Session; the server's certificate and signature are checked."""
    own = own or credentials(rank)
    hello = recv_exact(sock, 8 + 32)
    assert hello[:8] == b"PSAUTH03"
    server_share = hello[8:]
    ephemeral = X25519PrivateKey.generate()
    share = ephemeral.public_key().public_bytes_raw()
    certificate = struct.pack("<i", own.rank if claim is None else claim) + own.public_key + own.certificate
    body = share + bytes([PROTECTIONS[protection]]) + certificate
    signature = Ed25519PrivateKey.from_private_bytes(own.private_key).sign(b"peerstate-client" + hello + body)
    sock.sendall(body + signature)
    answer = recv_exact(sock, CERTIFICATE_BYTES + 64)
    server_certificate, server_signature = answer[:100], answer[100:]
    Ed25519PublicKey.from_public_bytes(own.job_key).verify(
        server_certificate[36:100], b"peerstate-rank-certificate" + server_certificate[:36])
    Ed25519PublicKey.from_public_bytes(server_certificate[4:36]).verify(
        server_signature, b"peerstate-server" + hello + body + signature + server_certificate)
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(server_share))

    def key(label):
        return hmac.new(shared, label + server_share + share, hashlib.sha256).digest()

    return Session(sock, protection, key(b"peerstate-frames-to-server"), key(b"peerstate-frames-to-client"))


def frame(type_, source_rank=0, chunk=0, version=0, length=0, crc=0, magic=MAGIC, status=0):
    return HEADER.pack(magic, type_, status, source_rank, chunk, version, length, crc, 0)


def closed_by_server(sock, timeout=5.0):
    """True when the server closes the connection (after any replies it sends)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def meta_bytes(info, version, rank, chunk_bytes):
    """A PUT_BEGIN's metadata for a version laid out as ``info`` (a store's ``version_info``)."""
    out = struct.pack("<iqQI", rank, version, chunk_bytes, len(info["buffers"]))
    for name, nbytes, device, _, dtype in info["buffers"]:
        out += struct.pack("<H", len(name)) + name.encode() + struct.pack("<Qi", nbytes, device)
        out += struct.pack("<H", len(dtype)) + dtype.encode()
    out += struct.pack("<I", len(info["checksums"])) + b"".join(struct.pack("<I", c) for c in info["checksums"])
    return out


class Rig:
    """A holder (rank 1) with its own snapshot and a committed replica of rank 0,
    plus everything a legitimate rank 0 needs to talk to it."""

    def __init__(self):
        self.source_store = peerstate.SnapshotStore(chunk_bytes=64 * 1024)
        self.source_state = {f"w{i}": torch.randn(50_000) for i in range(4)}
        self.source_store.register_many(self.source_state)
        self.source_store.snapshot(1).wait()

        self.own_store = peerstate.SnapshotStore()
        self.own_state = torch.randn(10_000)
        self.own_store.register("own", self.own_state)
        self.own_store.snapshot(7).wait()

        self.replicas = _C.ReplicaStore(budget_bytes=64 << 20)
        self.replicas.reserve(0, self.source_store.memory()["bytes_per_version"])
        self.server = _C.TcpServer(self.replicas, self.own_store.native, credentials=credentials(1),
                                   io_timeout_ms=1000)
        self.address = ("127.0.0.1", self.server.port)
        # The client's io timeout as the server's, as a job configures both ends: it reopens a pooled
        # connection idle for half of it, before the server closes it. With the default (30 s) it reused
        # connections the server had closed after 1 s, and under load a describe met one mid-close.
        self.transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=2, io_timeout_ms=1000)
        self.transport.add_peer(1, *self.address)
        replicator = _C.Replicator(self.source_store.native, self.transport, 0)
        replicator.replicate(1, [1])
        assert replicator.wait(1) == [(1, None)]
        self.meta = self.source_store.version_info(1)
        self.replica_digest = hashlib.sha256(self.replicas.stored_bytes(0)).hexdigest()
        self.own_digest = hashlib.sha256(bytes(self.own_store.stored_bytes(7))).hexdigest()

    def connect(self):
        return socket.create_connection(self.address, timeout=5)

    def valid_meta_bytes(self, version=100, rank=0):
        return meta_bytes(self.meta, version, rank, 64 * 1024)

    def assert_intact(self):
        assert self.replicas.committed() == [(0, 1)]
        assert hashlib.sha256(self.replicas.stored_bytes(0)).hexdigest() == self.replica_digest
        assert hashlib.sha256(bytes(self.own_store.stored_bytes(7))).hexdigest() == self.own_digest
        # ...and it still serves a legitimate client.
        assert self.transport.describe(1, 0, -1)["version"] == 1
        assert self.transport.describe(1, 1, -1)["version"] == 7

    def close(self):
        self.transport.abort()
        self.server.stop()
        self.source_store.close()
        self.own_store.close()

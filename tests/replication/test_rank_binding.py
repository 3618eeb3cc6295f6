"""A member of the job speaks only as the rank it was certified for
(csrc/net/credentials.h), against a holder in a process of its own: a rank's
credentials cannot push another rank's state, a certificate rewritten to
another rank is refused, and so is another rank's certificate (public: every
handshake shows it) shown without that rank's key. Throughout, the holder's
replica of the real rank stays as that rank pushed it."""

import json
import socket
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import peerstate
from peerstate import _C, _probes

from helpers.wire_client import SECRET, authenticate, closed_by_server, credentials

HOLDER = textwrap.dedent("""
    import json, sys
    from peerstate import _C, _probes
    replicas = _C.ReplicaStore(budget_bytes=64 << 20)
    for rank in (0, 2):
        replicas.reserve(rank, int(sys.argv[2]))
    job = _C.JobAuthority(bytes.fromhex(sys.argv[1]))
    server = _C.TcpServer(replicas, None, credentials=job.issue(1), io_timeout_ms=5000)
    print(server.port, flush=True)
    for line in sys.stdin:  # each line asks for what the holder holds
        print(json.dumps({"committed": replicas.committed(), "stats": server.stats(),
                          "crc": [_probes.crc32c(replicas.stored_bytes(r)) for r, _ in replicas.committed()]}),
              flush=True)
    server.stop()
""")


@pytest.fixture
def rank0_and_holder(tmp_path):
    """Rank 0's store with version 1 pushed to rank 1's holder (a child process, its log
    in tmp_path/holder.log), and a way to ask the holder what it holds."""
    source = peerstate.SnapshotStore(chunk_bytes=64 * 1024)
    source.register("w", torch.arange(100_000, dtype=torch.float32))
    log = open(tmp_path / "holder.log", "w")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, SECRET.hex(), str(source.memory()["bytes_per_version"])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        port = int(holder.stdout.readline())

        def holding():
            holder.stdin.write("?\n")
            holder.stdin.flush()
            return json.loads(holder.stdout.readline())

        honest = _C.TcpTransport(credentials=credentials(0), connections_per_peer=1, io_timeout_ms=5000)
        honest.add_peer(1, "127.0.0.1", port)
        source.snapshot(1).wait()
        replicator = _C.Replicator(source.native, honest, 0)
        replicator.replicate(1, [1])
        assert replicator.wait(1) == [(1, None)]
        assert holding()["committed"] == [[0, 1]]
        yield source, port, holding
        honest.abort()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        log.close()
        source.close()


def test_a_rank_cannot_push_another_ranks_state(rank0_and_holder, tmp_path):
    source, port, holding = rank0_and_holder
    before = holding()
    source.snapshot(2).wait()
    rank2 = _C.TcpTransport(credentials=credentials(2), connections_per_peer=1, io_timeout_ms=5000)
    rank2.add_peer(1, "127.0.0.1", port)
    replicator = _C.Replicator(source.native, rank2, 0)  # claims source rank 0
    replicator.replicate(2, [1])
    [(holder, error)] = replicator.wait(2)
    assert holder == 1 and isinstance(error, peerstate.PeerConnectionError)  # the holder closed the connection
    after = holding()
    assert "closing connection from rank 2 (127.0.0.1:" in (tmp_path / "holder.log").read_text()
    assert "rank 2 tried to push the state of rank 0" in (tmp_path / "holder.log").read_text()
    assert after["committed"] == [[0, 1]] and after["crc"] == before["crc"]
    rank2.abort()


def test_a_certificate_rewritten_to_another_rank_is_refused(rank0_and_holder):
    _, port, holding = rank0_and_holder
    rejected = holding()["stats"]["rejected"]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with pytest.raises(ConnectionError):
            authenticate(sock, rank=2, claim=0)  # rank 2's key and certificate, the rank rewritten to 0
        assert closed_by_server(sock)
    after = holding()
    assert after["stats"]["rejected"] == rejected + 1 and after["committed"] == [[0, 1]]


def test_another_ranks_certificate_without_its_key_is_refused(rank0_and_holder):
    _, port, holding = rank0_and_holder
    rejected = holding()["stats"]["rejected"]
    rank0, rank2 = credentials(0), credentials(2)
    # Rank 0's certificate and public key, as any handshake of rank 0 shows them, with rank 2's key.
    stolen = types.SimpleNamespace(rank=0, public_key=rank0.public_key, certificate=rank0.certificate,
                                   private_key=rank2.private_key, job_key=rank2.job_key)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with pytest.raises(ConnectionError):
            authenticate(sock, own=stolen)
        assert closed_by_server(sock)
    after = holding()
    assert after["stats"]["rejected"] == rejected + 1 and after["committed"] == [[0, 1]]
    # ...and the same certificate with its own key is served: the refusal was the key's.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        authenticate(sock, own=rank0)

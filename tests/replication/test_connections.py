"""How many connections a transfer opens: as many as it has chunks to carry, up to
``connections_per_peer`` (``net/tcp_transport``)."""

import pytest
import torch

import peerstate
from peerstate import _C

from helpers.wire_client import credentials


@pytest.mark.parametrize("values, connections", [(1_000, 1), (200_000, 4)], ids=["one-chunk", "many-chunks"])
def test_a_push_opens_no_more_connections_than_it_has_chunks(values, connections):
    # A one-chunk push (a data-parallel rank's own small state, every step) on four idle
    # links ran three empty threads a round, and the holder closed and the pusher reopened
    # those three every io timeout.
    source = peerstate.SnapshotStore(chunk_bytes=64 * 1024)
    source.register("w", torch.arange(values, dtype=torch.float32))
    replicas = _C.ReplicaStore(budget_bytes=16 << 20)
    replicas.reserve(0, source.memory()["bytes_per_version"])
    server = _C.TcpServer(replicas, None, credentials=credentials(1))
    transport = _C.TcpTransport(credentials=credentials(0), connections_per_peer=4)
    transport.add_peer(1, "127.0.0.1", server.port)
    replicator = _C.Replicator(source.native, transport, 0)
    try:
        for version in (1, 2, 3):
            source.snapshot(version).wait()
            replicator.replicate(version, [1])
            assert replicator.wait(version) == [(1, None)]
        assert (0, 3) in replicas.committed(), replicas.committed()
        assert server.stats()["accepted"] == connections, server.stats()
    finally:
        transport.abort()
        server.stop()
        source.close()

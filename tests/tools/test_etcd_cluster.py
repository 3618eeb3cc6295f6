"""The tests' and benchmarks' etcd clusters (``tools.etcd_cluster``): each member
gets ports of its own, and a port another process takes between the pick and
etcd's bind costs a restart, not the test (real etcd members on 127.0.0.1)."""

import socket

from helpers.etcd import EtcdCluster
from peerstate.tools import etcd_cluster


def test_the_ports_picked_for_one_cluster_are_distinct_and_free():
    ports = etcd_cluster._free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_a_cluster_whose_port_another_process_took_starts_again_on_new_ones(tmp_path, monkeypatch):
    taken = socket.create_server(("127.0.0.1", 0))  # what another process holds when etcd binds
    picks, pick = [], etcd_cluster._free_ports

    def first_pick_lost(count):
        ports = pick(count)
        if not picks:
            ports[-1] = taken.getsockname()[1]  # the last member's peer port
        picks.append(ports)
        return ports

    monkeypatch.setattr(etcd_cluster, "_free_ports", first_pick_lost)
    try:
        cluster = EtcdCluster(tmp_path, members=3)
        try:
            assert len(picks) == 2 and taken.getsockname()[1] not in cluster.client_ports
            assert cluster.leader() in range(3)
        finally:
            cluster.close()
    finally:
        taken.close()

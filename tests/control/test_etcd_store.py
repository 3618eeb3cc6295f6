"""EtcdKeyValueStore against real etcd clusters on 127.0.0.1: what the store's own
failures do (a lost leader, a store gone past its bound), the interrupt an abort
uses, and torch's process groups formed through it (the contract itself is in
test_kvstore.py)."""

import http.client
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("torch")

from helpers.etcd import EtcdCluster, make_tls  # noqa: E402

from peerstate.control.etcd_store import EtcdKeyValueStore, TlsFiles  # noqa: E402
from peerstate.errors import InvalidArgumentError, StoreUnavailableError  # noqa: E402


@pytest.fixture
def cluster(tmp_path, request):
    etcd = EtcdCluster(tmp_path, members=getattr(request, "param", 1))
    yield etcd
    etcd.close()


@pytest.mark.e2e
@pytest.mark.parametrize("cluster", [3], indirect=True)
def test_losing_the_leader_loses_no_write_and_no_wait(cluster):
    kv = EtcdKeyValueStore(cluster.endpoints, "/peerstate/leader/", unavailable_timeout=15)
    other = kv.clone()
    kv.set("before", b"1")
    assert kv.compare_set("owner", b"", b"agent0") == b"agent0"
    for _ in range(5):
        kv.add("counter", 1)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(kv.clone().wait(["after"], timeout=20) or True))
    waiter.start()
    cluster.kill(cluster.leader())
    # every call goes on, on the members left: no write lost, the winner still wins
    other.set("after", b"2")
    assert kv.get_many(["before", "after"]) == [b"1", b"2"]
    assert kv.compare_set("owner", b"", b"agent1") == b"agent0"
    assert kv.add("counter", 1) == 6
    waiter.join(20)
    assert waited == [True]


def test_a_store_gone_past_its_bound_raises_naming_it_and_the_bound(cluster):
    kv = EtcdKeyValueStore(cluster.endpoints, "/peerstate/gone/", unavailable_timeout=1.0)
    kv.set("k", b"v")
    cluster.kill(0)
    for call in (lambda: kv.get("k"), lambda: kv.add("n", 1), lambda: kv.wait(["never"], timeout=30)):
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as raised:
            call()
        assert time.monotonic() - started < 10
        assert cluster.endpoints[0] in str(raised.value) and "for 1s" in str(raised.value)


def test_a_watch_from_a_compacted_revision_reads_what_it_missed(cluster):
    # A shared etcd (Kubernetes') compacts its history every few minutes: a watch that
    # starts again from an old revision is cancelled, and must not miss the key.
    kv = EtcdKeyValueStore(cluster.endpoints, "/peerstate/compacted/")
    kv.set("k", b"1")
    for value in range(5):
        kv.set("other", str(value).encode())
    head = int(_post(cluster, "/v3/kv/range", {"key": "eA=="})["header"]["revision"])
    _post(cluster, "/v3/kv/compaction", {"revision": str(head), "physical": True})
    assert kv._watch_for(["k"], 2, time.monotonic() + 5) == {"k": b"1"}  # k is there
    with pytest.raises(TimeoutError):
        kv._watch_for(["k", "absent"], 2, time.monotonic() + 0.5)


def _post(cluster, path, body):
    """A request of our own to the first member (not through the store under test)."""
    connection = http.client.HTTPConnection("127.0.0.1", cluster.client_ports[0], timeout=5)
    try:
        connection.request("POST", path, body=json.dumps(body))
        response = connection.getresponse()
        data = response.read()
        assert response.status == 200, data
        return json.loads(data)
    finally:
        connection.close()


def test_interrupt_fails_a_blocked_wait_at_once(cluster):
    kv = EtcdKeyValueStore(cluster.endpoints, "/peerstate/interrupt/")
    outcome = []

    def wait():
        try:
            kv.wait(["never"], timeout=30)
        except ConnectionAbortedError:
            outcome.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    asked = time.monotonic()
    kv.interrupt()
    waiter.join(5)
    assert outcome and outcome[0] - asked < 2


RANK_SCRIPT = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist
    from peerstate.control.etcd_store import EtcdKeyValueStore
    rank, endpoints = int(sys.argv[1]), sys.argv[2].split(",")
    store = EtcdKeyValueStore(endpoints, "/peerstate/groups/").rendezvous_store()
    dist.init_process_group("gloo", store=dist.PrefixStore("epoch1/", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    sub = dist.new_group([0, 1])
    dist.all_reduce(t, group=sub)
    print(t.tolist(), flush=True)
    dist.destroy_process_group()
""")


def test_torch_process_groups_form_through_it(cluster, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), ",".join(cluster.endpoints)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=60)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], outputs
    assert all(out.strip().splitlines()[-1] == "[6.0, 6.0, 6.0]" for out in outputs), outputs


def test_a_tls_cluster_that_asks_for_client_certificates(tmp_path):
    # Kubernetes' etcd speaks TLS and wants a client certificate: the store presents one,
    # hands the files on in its address (what a worker opens), and a missing one is a
    # configuration error at once, not an unavailable store.
    tls = make_tls(tmp_path)
    cluster = EtcdCluster(tmp_path, tls=tls)
    try:
        files = TlsFiles(tls.ca, tls.client_cert, tls.client_key)
        kv = EtcdKeyValueStore.for_job(cluster.url, "tls", tls=files)
        assert kv.compare_set("owner", b"", b"agent0") == b"agent0"
        threading.Timer(0.1, kv.clone().set, args=("later", b"1")).start()
        assert kv.wait_get("later", timeout=60) == b"1"
        worker = EtcdKeyValueStore.from_address(kv.address)
        assert worker.address.startswith("etcds://") and worker.get("owner") == b"agent0"
        # A store retried past its bound raises StoreUnavailableError; a configuration error is
        # InvalidArgumentError, raised without retrying (the type is the check, not the time taken).
        for anonymous in (TlsFiles(tls.ca), TlsFiles()):  # no client certificate; then not even the CA
            with pytest.raises(InvalidArgumentError, match="TLS handshake with etcd at 127.0.0.1.* --store-cert"):
                EtcdKeyValueStore.for_job(cluster.url, "tls", tls=anonymous).get("owner")
    finally:
        cluster.close()


def test_a_clone_of_the_rendezvous_store_is_a_connection_of_its_own_that_torch_can_keep(cluster):
    import gc

    import torch.distributed as dist

    store = EtcdKeyValueStore(cluster.endpoints, "/peerstate/clone/").rendezvous_store()
    prefixed = dist.PrefixStore("g/", store.clone())  # as shrink_group does: torch keeps only the C++ half
    gc.collect()
    prefixed.set("k", b"v")
    assert store.get("g//k") == b"v" and prefixed.get("k") == b"v"  # PrefixStore joins with "/"

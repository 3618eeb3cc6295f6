"""The KeyValueStore contract, held by every implementation: TCPStore (real
server on 127.0.0.1, port 0), etcd (a real one-member cluster; its failures are
in test_etcd_store.py) and the in-memory store for pure-logic tests."""

import itertools
import threading
import time

import pytest

pytest.importorskip("torch")

from peerstate.control.coordinator import Coordinator  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.control.memory_store import InMemoryKeyValueStore  # noqa: E402
from peerstate.control.etcd_store import EtcdKeyValueStore  # noqa: E402
from helpers.etcd import EtcdCluster  # noqa: E402

MEMBERS = {r: f"n{r // 2}.{r % 2}" for r in range(4)}
_jobs = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    yield cluster
    cluster.close()


@pytest.fixture(params=["tcpstore", "etcd", "memory"])
def kv(request):
    if request.param == "memory":
        return InMemoryKeyValueStore()
    if request.param == "etcd":  # one cluster for the module, a job prefix per test
        return EtcdKeyValueStore(request.getfixturevalue("etcd").endpoints, f"/peerstate/contract-{next(_jobs)}/")
    return TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)


def test_get_set_and_missing_keys(kv):
    assert kv.get("a") is None
    kv.set("a", b"1")
    assert kv.get_many(["a", "b"]) == [b"1", None]


def test_delete_many_removes_the_keys_and_passes_over_missing_ones(kv):
    kv.set_many([("a", b"1"), ("b", b"2"), ("c", b"3")])
    kv.delete_many(["a", "never", "c"])
    assert kv.clone().get_many(["a", "b", "c"]) == [None, b"2", None]


def test_add_and_compare_set_are_atomic_across_clients(kv):
    clients = [kv.clone() for _ in range(4)]
    winners = []

    def race(client, name):
        for _ in range(50):
            client.add("counter", 1)
        if client.compare_set("owner", b"", name.encode()) == name.encode():
            winners.append(name)

    threads = [threading.Thread(target=race, args=(c, f"c{i}")) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kv.add("counter", 0) == 200
    assert len(winners) == 1 and kv.get("owner") == winners[0].encode()
    assert kv.compare_set("owner", b"someone else", b"x") == winners[0].encode()


def test_append_and_wait(kv):
    kv.append("list", b"a,")
    kv.append("list", b"b,")
    assert kv.get("list") == b"a,b,"
    with pytest.raises(TimeoutError):
        kv.wait(["never"], timeout=0.2)
    threading.Timer(0.1, kv.clone().set, args=("later", b"1")).start()
    kv.wait(["later"], timeout=5)
    threading.Timer(0.1, kv.clone().set, args=("b", b"2")).start()
    threading.Timer(0.2, kv.clone().set, args=("a", b"1")).start()
    kv.wait(["a", "b"], timeout=5)  # two keys, put in another order
    assert kv.get_many(["a", "b"]) == [b"1", b"2"]
    threading.Timer(0.1, kv.clone().set, args=("value later", b"v")).start()
    assert kv.wait_get("value later", timeout=5) == b"v"  # the value the wait saw put
    assert kv.wait_get("value later", timeout=0.1) == b"v"  # there already
    with pytest.raises(TimeoutError):
        kv.wait_get("never", timeout=0.2)


def test_one_plan_per_epoch_over_either_store(kv):
    coordinator = Coordinator(kv)
    kv.set("config", b'{"nnodes": 2, "nproc_per_node": 2, "world_size": 4}')
    coordinator.start("agent0")
    for spare in ("n0.2", "n1.2"):
        coordinator.register_spare(spare)
    plans = []

    def report(i):
        plans.append(Coordinator(kv.clone()).report_failure(["n1.0"], "killed", detected_at=1.0, me=f"agent{i}"))

    threads = [threading.Thread(target=report, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [p for p in plans if p is not None]  # a loser whose failure the winner covered gets None
    assert made and {p.epoch for p in made} == {1} and len({p.replaced[2] for p in made}) == 1
    latest = coordinator.latest_plan()
    assert latest.epoch == 1 and latest.members[2] == made[0].replaced[2]


def test_reading_a_missing_key_wakes_no_one_waiting_for_it(kv):
    # TCPStore's libuv server wakes every client waiting for a key when anyone compare_sets
    # that key while it is missing (they then take it as set): a read must never do that.
    waiter, outcome = kv.clone(), {}

    def wait():
        try:
            waiter.wait(["plan"], timeout=1.5)
            outcome["woke"] = kv.get("plan")
        except TimeoutError:
            outcome["timed out"] = True

    thread = threading.Thread(target=wait)
    thread.start()
    for _ in range(5):
        assert kv.get("plan") is None and kv.get_many(["plan"]) == [None]
    thread.join(5)
    assert outcome == {"timed out": True}
    kv.set("plan", b"p")
    assert kv.get_existing(["plan"]) == [b"p"] and kv.get("plan") == b"p"


def test_wait_until_returns_once_the_keys_exist_and_asks_moot_only_while_they_do_not(kv):
    asked = []
    writer = kv.clone()

    def moot():
        asked.append(len(asked))
        if len(asked) == 2:  # the keys appear while the waiter polls, not before it began
            writer.set_many([("w/a", b"1"), ("w/b", b"2")])
        return False

    assert kv.wait_until(["w/a", "w/b"], time.monotonic() + 60, moot, poll=0.01) is True
    assert len(asked) in (2, 3), asked  # the wait that began after the second ask saw them


def test_wait_until_ends_as_soon_as_the_wait_is_moot_and_passes_on_what_moot_raises(kv):
    calls = []
    assert kv.wait_until(["never"], time.monotonic() + 60, lambda: calls.append(1) or len(calls) == 3,
                         poll=0.01) is False
    assert len(calls) == 3

    class Superseded(Exception):
        pass

    def superseded():
        raise Superseded()

    with pytest.raises(Superseded):
        kv.wait_until(["never"], time.monotonic() + 60, superseded, poll=0.01)


def test_wait_until_raises_timeout_error_at_its_deadline_after_asking_moot(kv):
    calls = []
    with pytest.raises(TimeoutError):
        kv.wait_until(["never"], time.monotonic() + 0.05, lambda: calls.append(1) or False, poll=0.01)
    assert calls, "moot() was never asked before the deadline ended the wait"
    kv.set("now", b"1")
    assert kv.wait_until(["now"], time.monotonic() - 1) is True  # keys there: a past deadline does not matter


def test_an_interrupted_clone_ends_its_blocked_wait_at_once_and_the_store_goes_on(kv):
    # The agent's end: its relay waits up to a second for the next plan on a clone of its
    # own; interrupting that clone ends the wait now instead, with an error that says the
    # connection is gone (the relay, told to stop, returns quietly on it).
    from peerstate.control.kvstore import store_gone

    waiter, outcome = kv.clone(), {}
    started = threading.Event()

    def wait():
        started.set()
        try:
            waiter.wait(["plan"], timeout=60)
            outcome["returned"] = True
        except Exception as error:  # noqa: BLE001 - what it raised is the outcome
            outcome["error"] = error

    thread = threading.Thread(target=wait)
    thread.start()
    started.wait(5)
    time.sleep(0.2)  # into its wait (an interrupt before it must fail the wait too)
    waiter.interrupt()
    thread.join(30)
    assert not thread.is_alive(), "the interrupted wait still blocks"
    assert store_gone(outcome["error"]) and not isinstance(outcome["error"], TimeoutError), outcome
    with pytest.raises(Exception) as later:
        waiter.wait(["plan"], timeout=5)
    assert store_gone(later.value), later.value
    kv.set("plan", b"p")  # the store and its other connections are untouched
    assert kv.get("plan") == b"p" and kv.clone().get_existing(["plan"]) == [b"p"]

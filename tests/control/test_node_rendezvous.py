"""The rendezvous store a node's workers share (``control.node_rendezvous``), over a
real TCPStore for the job and a real one for the node channel: a node reads each
set of keys from the job's store once, whichever of its members asks first; a
member that fails its read gives it back and another takes it over; writes go to
the job's store; a worker without a channel reads for itself."""

import datetime
import threading

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from peerstate.control import keys  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.control.node_rendezvous import node_rendezvous_store  # noqa: E402

IDS = [f"pg/3/0/cuda/UniqueNCCLID:{r}" for r in range(16)]


@pytest.fixture
def stores():
    job = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    channel = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    yield job, channel


def _member(job, channel, timeout=30.0):
    """One worker's store: connections of its own to the job's store and the channel."""
    return node_rendezvous_store(job.rendezvous_store(), channel.clone() if channel else None, timeout)


def _read_in_threads(members, names):
    results, errors = {}, []

    def read(index):
        try:
            results[index] = members[index].multi_get(names)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(members))]
    for thread in threads:
        thread.start()
    return threads, results, errors


def test_a_nodes_members_read_a_set_of_keys_from_the_job_store_once(stores):
    job, channel = stores
    members = [_member(job, channel) for _ in range(8)]
    threads, results, errors = _read_in_threads(members, IDS)
    # The members wait for the roots' ids; one of them waits in the job's store.
    channel.wait([keys.rendezvous_claim(_digest(IDS))], timeout=30)
    values = [f"id of root {r}".encode() for r in range(len(IDS))]
    roots = node_rendezvous_store(job.rendezvous_store(), None, 30)  # another node's roots
    for name, value in zip(IDS, values):
        roots.set(name, value)
    for thread in threads:
        thread.join(60)
    assert not errors and len(results) == 8
    assert all(result == values for result in results.values())
    reads = sorted(m.count.requests for m in members)
    assert reads == [0] * 7 + [2], reads  # one multi_get (TCPStore's wait and read) for the node
    assert sum(m.count.bytes_received for m in members) == sum(len(v) for v in values)
    assert roots.count.requests == len(IDS)  # the writes went to the job's store, one each
    for member in members:  # the epoch's groups are gone: the node's copies go too
        member.forget()
    assert [k for k in channel.torch_store.list_keys() if k.startswith(keys.rendezvous_read(""))] == []


def test_without_a_channel_every_member_reads_for_itself(stores):
    job, _ = stores
    for name in IDS:
        job.set(name, b"x")
    members = [_member(job, None) for _ in range(3)]
    for member in members:
        assert member.multi_get(IDS) == [b"x"] * len(IDS)
        assert member.count.requests == 2


def test_a_single_key_read_after_a_wait_for_it_is_served_by_the_node(stores):
    # gloo's pattern: wait for a peer's address, then get it.
    job, channel = stores
    job.set("pg/1/0/rank_1", b"address")
    first, second = _member(job, channel), _member(job, channel)
    first.wait(["pg/1/0/rank_1"], datetime.timedelta(seconds=10))
    assert first.count.requests == 3  # its own wait, then TCPStore's wait and read
    assert first.get("pg/1/0/rank_1") == b"address" and second.get("pg/1/0/rank_1") == b"address"
    assert (first.count.requests, second.count.requests) == (3, 0)


def test_a_member_whose_read_fails_gives_it_back_and_another_takes_it_over(stores):
    job, channel = stores
    quick = _member(job, channel, timeout=0.5)  # its read times out before the ids come
    patient = _member(job, channel, timeout=60)
    claim = keys.rendezvous_claim(_digest(IDS))
    with pytest.raises(dist.DistStoreError):
        quick.multi_get(IDS)
    assert channel.get(claim) == b""  # given back
    threads, results, errors = _read_in_threads([patient], IDS)
    channel.wait([claim], timeout=30)
    job.torch_store.multi_set(IDS, [b"v"] * len(IDS))
    for thread in threads:
        thread.join(60)
    assert not errors and results[0] == [b"v"] * len(IDS)
    assert patient.count.requests == 2  # it read them from the job's store itself


def test_a_member_waiting_for_the_claimant_takes_over_when_the_claimant_fails(stores):
    job, channel = stores
    claimant = _member(job, channel, timeout=1.0)
    waiter = _member(job, channel, timeout=60)
    claim = keys.rendezvous_claim(_digest(IDS))
    failed = []

    def claimant_reads():
        try:
            claimant.multi_get(IDS)
        except dist.DistStoreError as error:
            failed.append(error)

    first = threading.Thread(target=claimant_reads)
    first.start()
    channel.wait([claim], timeout=30)  # the claimant holds the read
    threads, results, errors = _read_in_threads([waiter], IDS)
    first.join(30)
    assert failed, "the claimant's read did not fail"
    job.torch_store.multi_set(IDS, [b"w"] * len(IDS))
    for thread in threads:
        thread.join(60)
    assert not errors and results[0] == [b"w"] * len(IDS)
    assert waiter.count.requests == 2 and claimant.count.requests == 2


def test_a_read_that_no_member_can_make_times_out_with_torchs_error(stores):
    job, channel = stores
    waiter = _member(job, channel, timeout=0.5)
    channel.compare_set(keys.rendezvous_claim("pg/9/never"), b"", b"someone else")  # a claimant that hangs
    with pytest.raises(dist.DistStoreError, match="another worker of this node"):
        waiter.get("pg/9/never")
    assert waiter.count.requests == 0  # it left the read to the claimant


def _digest(names):
    import hashlib

    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def test_a_clone_reads_through_the_same_node_counts_into_the_same_count_and_outlives_its_python_name(stores):
    import gc

    job, channel = stores
    member = _member(job, channel)
    prefixed = dist.PrefixStore("g", member.clone())  # as shrink_group does: torch keeps only the C++ half
    gc.collect()
    job.set("g/k", b"v")
    assert prefixed.get("k") == b"v"  # read through the node: the value is in the channel now
    assert channel.get(keys.rendezvous_read("g/k")) is not None
    assert member.count.requests == 2

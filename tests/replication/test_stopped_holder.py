"""A hung (stopped) holder's stores, read from its memory by its replacement on
the same machine: real processes, SIGSTOP, kill -9 (see replication.stopped_holder)."""

import ctypes
import signal
import subprocess
import sys

import pytest

from peerstate import _C

from helpers.cluster import Cluster, PeerError

pytestmark = pytest.mark.e2e  # several real processes per test: left out of `-m "not e2e"`

SMALL = dict(large_bytes=2 << 20, small_count=200, small_bytes=1024, chunk_bytes=256 << 10)


def _run_three_steps(cluster):
    """Both ranks index their stores and take versions 1-3, replicated to each other.
    Returns {rank: digest of its version 3} and {rank: (pid, index address)}."""
    indexes = {r: cluster.peers[r].call("index") for r in (0, 1)}
    digests = {}
    for version in (1, 2, 3):
        for r in (0, 1):
            digests[r] = cluster.peers[r].call("step", version=version)["digest"]
        for r in (0, 1):
            assert cluster.peers[r].call("wait", version=version)["results"] == {str(1 - r): None}
    return digests, {r: (i["pid"], i["address"]) for r, i in indexes.items()}


def test_a_hung_rank_and_its_killed_buddy_both_come_back_from_the_hung_ones_memory():
    # Rank 1 hangs (SIGSTOP); then its buddy, rank 0, is killed: rank 0's only copy is the
    # replica inside the stopped rank 1, and rank 1's own state is only in itself.
    with Cluster(["a", "b"], k=1, **SMALL) as cluster:
        digests, indexes = _run_three_steps(cluster)
        cluster.peers[1].signal(signal.SIGSTOP)
        cluster.peers[0].kill()
        replacement1 = cluster.start(1, name="replacement1")
        adopted = replacement1.call("adopt", pid=indexes[1][0], address=indexes[1][1])
        assert adopted["adopted"] == {"0": [2, 3]} and adopted["refused"] == [] and adopted["own"] == [2, 3], adopted
        # Its own versions were adopted too (its buffers are registered): nothing left to move.
        got = replacement1.call("recover", rank=1, version=3, sources=[], same_machine={})
        assert got["version"] == 3 and got["digest"] == digests[1] and got["chunks"] == 0, got
        cluster.peers[1].kill()  # the stopped one is no longer needed
        # Rank 0's replacement pulls from rank 1's replacement, which now serves the adopted replica.
        addresses = dict(cluster.addresses, **{"1": ["127.0.0.1", replacement1.call("port")["port"]]})
        replacement0 = cluster.start(0, name="replacement0")
        replacement0.call("connect", addresses=addresses)
        got = replacement0.call("recover", rank=0, version=3, sources=[1])
        assert got == {"ok": True, "version": 3, "digest": digests[0]}


def test_an_index_entry_whose_bytes_changed_is_refused_not_adopted():
    # The stopped process's memory no longer matches what its index says (a region reused
    # after the entry was written, here: a version of rank 1 overwritten in place by the
    # test): its checksums refuse it, and the store keeps what it had.
    with Cluster(["a", "b"], k=1, **SMALL) as cluster:
        digests, indexes = _run_three_steps(cluster)
        cluster.peers[1].signal(signal.SIGSTOP)
        [(region, nbytes)] = [(e[3], e[4]) for e in _C.read_process_index(*indexes[1]) if e[:3] == (1, 0, 3)]
        _write_memory(indexes[1][0], region + nbytes // 2, b"\xff" * 64)
        replacement1 = cluster.start(1, name="replacement1")
        adopted = replacement1.call("adopt", pid=indexes[1][0], address=indexes[1][1])
        assert adopted["adopted"] == {"0": [2]}, adopted
        [refused] = adopted["refused"]
        assert "version 3 of rank 0" in refused and "CRC32C" in refused, refused


def test_a_stopped_holder_that_is_gone_or_not_an_index_is_a_clear_error():
    with Cluster(["a", "b"], k=1, **SMALL) as cluster:
        _, indexes = _run_three_steps(cluster)
        pid, address = indexes[1]
        replacement1 = cluster.start(1, name="replacement1")
        with pytest.raises(PeerError, match="not a peerstate index"):
            replacement1.call("adopt", pid=pid, address=address + 64)
        cluster.peers[1].kill()
        cluster.peers[1].proc.wait()
        with pytest.raises(PeerError, match=f"process {pid}"):
            replacement1.call("adopt", pid=pid, address=address)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _write_memory(pid, address, data):
    """process_vm_writev(2): change bytes in another process of this user."""
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(data, len(data))
    local = _IoVec(ctypes.cast(buffer, ctypes.c_void_p), len(data))
    remote = _IoVec(address, len(data))
    assert libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == len(data), \
        ctypes.get_errno()


YAMA = "/proc/sys/kernel/yama/ptrace_scope"
# A process that permits, or not, its parent's descendants to read it; then waits.
TARGET = """
import sys
from peerstate.replication.stopped_holder import permit_reads_by_the_node
if sys.argv[1] == "permit":
    assert permit_reads_by_the_node()
print("ready", flush=True)
sys.stdin.readline()
"""
# A sibling that reads an index at a bad address there: refused by ptrace rules, or read
# and found to be no index.
READER = """
import sys
from peerstate import _C
try:
    _C.read_process_index(int(sys.argv[1]), 4096)
except Exception as error:
    print(error, flush=True)
"""


def _yama_mode():
    try:
        with open(YAMA) as f:
            return int(f.read())
    except FileNotFoundError:
        return None


@pytest.mark.skipif(_yama_mode() != 1, reason=f"needs Yama's ptrace_scope=1 ({YAMA}: {_yama_mode()})")
@pytest.mark.parametrize("permit", [True, False], ids=["permitted", "not-permitted"])
def test_under_yama_a_worker_that_permits_its_node_is_read_by_a_sibling(permit):
    # Ubuntu's default forbids reading a sibling's memory: a worker names its parent, whose
    # descendants (the node's workers and spares) may then read it; without that, refused.
    target = subprocess.Popen([sys.executable, "-c", TARGET, "permit" if permit else "keep"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline() == "ready\n"
        said = subprocess.run([sys.executable, "-c", READER, str(target.pid)], capture_output=True, text=True,
                              timeout=60).stdout
        assert ("not permitted" in said) != permit, said
    finally:
        target.kill()
        target.wait()


def test_permitting_the_node_is_harmless_where_yama_is_absent_or_off():
    from peerstate.replication.stopped_holder import permit_reads_by_the_node

    took = permit_reads_by_the_node()
    assert took == (_yama_mode() is not None), (took, _yama_mode())

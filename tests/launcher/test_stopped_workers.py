"""A hung worker kept stopped for its replacement (launcher.stopped_workers), on real
processes, a real node channel (TCPStore) and real signals."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerstate.control import keys
from peerstate.control import progress
from peerstate.control.kvstore import TorchKeyValueStore
from peerstate.control.timeline import EventLog
from peerstate.launcher.processes import WorkerProcess
from peerstate.launcher.stopped_workers import StoppedWorkers
from peerstate.tools.local import wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def state(pid):
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2:].split()[0]


@pytest.fixture
def node(tmp_path):
    """(make(rank, index_address, spare) -> WorkerProcess, StoppedWorkers, channel, events path);
    every process it starts is killed at the end."""
    channel = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
    events = tmp_path / "events.jsonl"
    started = []

    def make(rank, address=0, ready=False):
        path = str(tmp_path / f"w{len(started)}.progress")
        progress.create(path)
        counter = progress.ProgressCounter(path)
        counter.set_index_address(address)
        popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        started.append(popen)
        process = WorkerProcess(f"n0.{len(started)}", rank, popen, counter, tmp_path / "log")
        process.ready = ready
        return process

    yield make, StoppedWorkers(channel, EventLog(str(events), "agent0"), hold_seconds=1.0), channel, events
    for popen in started:
        popen.kill()
        popen.wait()


def test_a_hung_worker_is_kept_stopped_until_its_replacement_releases_it(node):
    make, stopped, channel, events = node
    hung, spare = make(3, address=0x7F00_0000_1000), make(None, ready=True)
    assert stopped.freeze(hung, [hung, spare])
    wait_until(lambda: state(hung.popen.pid) == b"T", "the stop", 10, [])
    assert channel.get(keys.stopped_holder(3)) == f"{hung.popen.pid}:{0x7F00_0000_1000}".encode()
    stopped.kill_released(time.monotonic())
    assert hung.popen.poll() is None  # not released, hold not over: still there to be read
    channel.set(keys.stopped_holder_released(hung.popen.pid), b"1")
    stopped.kill_released(time.monotonic())
    assert hung.popen.wait(10) == -9
    assert stopped.forget(hung)  # its exit is not a new failure: it was reported when frozen
    assert channel.get(keys.stopped_holder(3)) == b""  # a later replacement of rank 3 reads none
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert kinds == ["hung_worker_frozen", "hung_worker_killed"]


def test_one_never_released_is_killed_at_the_end_of_its_hold(node):
    make, stopped, channel, _ = node
    hung, spare = make(1, address=4096), make(None, ready=True)
    assert stopped.freeze(hung, [hung, spare])
    stopped.kill_released(time.monotonic() + 0.5)
    assert hung.popen.poll() is None
    stopped.kill_released(time.monotonic() + 1.0)  # the hold (1 s here) is over
    assert hung.popen.wait(10) == -9


@pytest.mark.parametrize("address, ready", [(0, True), (4096, False)], ids=["no-index", "no-spare-waiting"])
def test_a_hung_worker_nobody_on_its_node_can_read_is_not_frozen(node, address, ready):
    # The caller kills it at once, as before: a replacement on another node could not read it.
    make, stopped, channel, _ = node
    hung, spare = make(2, address=address), make(None, ready=ready)
    assert not stopped.freeze(hung, [hung, spare])
    assert state(hung.popen.pid) != b"T" and channel.get(keys.stopped_holder(2)) is None
    assert not stopped.forget(hung)

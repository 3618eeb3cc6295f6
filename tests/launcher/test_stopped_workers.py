"""A hung worker kept stopped for its replacement (launcher.stopped_workers), on real
processes, a real node channel (TCPStore) and real signals."""

import json
import signal
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
    """(make(rank, index_address) -> WorkerProcess, StoppedWorkers, channel, events path);
    every process it starts is killed, and every watch of it closed, at the end."""
    channel = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
    events = tmp_path / "events.jsonl"
    started, watched = [], []

    def make(rank, address=0):
        path = str(tmp_path / f"w{len(started)}.progress")
        progress.create(path)
        counter = progress.ProgressCounter(path)
        counter.set_index_address(address)
        popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        started.append(popen)
        watched.append(WorkerProcess(f"n0.{len(started)}", rank, popen, counter, tmp_path / "log"))
        return watched[-1]

    yield make, StoppedWorkers(channel, EventLog(str(events), "agent0"), hold_seconds=1.0), channel, events
    for popen in started:
        popen.kill()
        popen.wait()
    for process in watched:
        process.counter.close()
        process.exit_watch.close()


def test_a_hung_worker_is_kept_stopped_until_its_replacement_releases_it(node):
    make, stopped, channel, events = node
    hung = make(3, address=0x7F00_0000_1000)
    assert stopped.freeze(hung)
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
    hung = make(1, address=4096)
    assert stopped.freeze(hung)
    stopped.kill_released(time.monotonic() + 0.5)
    assert hung.popen.poll() is None
    stopped.kill_released(time.monotonic() + 1.0)  # the hold (1 s here) is over
    assert hung.popen.wait(10) == -9


def test_a_hung_worker_with_no_index_is_not_frozen(node):
    # It has no rank and no stores yet (a spare): the caller kills it at once, as before.
    make, stopped, channel, _ = node
    hung = make(2, address=0)
    assert not stopped.freeze(hung)
    assert state(hung.popen.pid) != b"T" and channel.get(keys.stopped_holder(2)) is None
    assert not stopped.forget(hung)


def test_a_worker_that_died_before_it_could_be_stopped_or_killed_raises_nothing(node):
    # A hung worker can die, and be reaped, between the agent's reading of its counter and
    # its signal: freezing it is declined (the caller kills it), and the kill finds no group.
    make, stopped, channel, _ = node
    hung = make(2, address=7)
    assert hung.signal_group(signal.SIGSTOP)
    wait_until(lambda: state(hung.popen.pid) == b"T", "the stop", 10, [])
    hung.popen.kill()
    assert hung.popen.wait() == -signal.SIGKILL
    assert not stopped.freeze(hung)
    assert channel.get(keys.stopped_holder(2)) is None
    assert not hung.signal_group(signal.SIGKILL)

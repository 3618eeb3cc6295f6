"""Frozen or merely slow: what the agent's watch makes of a worker whose liveness count
stands still, on real processes in real cgroups. Stopped (SIGSTOP) and cgroup-frozen
(v1 and v2) workers are frozen; one throttled by its CPU quota is not (one starved on
a node whose every core is busy: tests/e2e/test_under_load.py)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.load import cpu_quota, freezer
from peerstate.control import progress
from peerstate.launcher import kernel_state
from peerstate.launcher.processes import WorkerProcess

pytestmark = pytest.mark.skipif(not kernel_state.AVAILABLE, reason="needs Linux /proc")

# A worker that ticks (as a worker's Job does) and keeps its main thread busy, as a training step does.
BUSY_WORKER = """
import sys, time
from peerstate.control.progress import ProgressCounter
counter = ProgressCounter(sys.argv[1])
counter.start_ticking(0.05)
counter.set_step(5)
print("ticking", flush=True)
end = time.monotonic() + 120
while time.monotonic() < end:
    sum(range(1000))
"""
BOUNDS = dict(hang_timeout=60.0, join_timeout=60.0, freeze_timeout=0.3)


@pytest.fixture
def watched(tmp_path):
    """A busy worker and the agent's view of it (``WorkerProcess``)."""
    path = str(tmp_path / "worker.progress")
    progress.create(path)
    process = subprocess.Popen([sys.executable, "-c", BUSY_WORKER, path], stdout=subprocess.PIPE, text=True)
    watch = WorkerProcess("n0.0", 0, process, progress.ProgressCounter(path), Path(tmp_path) / "log")
    try:
        assert process.stdout.readline() == "ticking\n"
        yield process, watch
    finally:
        process.kill()
        process.wait()
        watch.counter.close()
        watch.exit_watch.close()


def watch_for(watch, seconds, until="never"):
    """Read the worker as the agent's watch does, every 20 ms, for ``seconds`` (or until
    ``until`` is seen). Returns the causes seen and the longest time its liveness count
    stood still."""
    causes, longest = set(), 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end and until not in causes:
        now = time.monotonic()
        causes.add(watch.read_progress(now, **BOUNDS))
        longest = max(longest, now - watch.liveness_at)
        time.sleep(0.02)
    return causes, longest


def test_a_worker_throttled_by_its_cpu_quota_is_not_frozen_though_its_count_stands_still(watched):
    process, watch = watched
    # 50 ms of CPU a second: the count stands still for most of each second, longer than the
    # freeze bound (0.3 s), as a container's CPU limit can hold a training process.
    with cpu_quota(0.05, 1.0) as group:
        group.add(process.pid)
        causes, longest = watch_for(watch, 4.0)
        assert longest > BOUNDS["freeze_timeout"], f"the quota never held the count past the bound ({longest:.2f}s)"
        assert causes == {None}, watch.frozen
        process.send_signal(signal.SIGSTOP)  # while throttled: stopped all the same
        causes, _ = watch_for(watch, 30.0, until="frozen")
        assert "frozen" in causes and watch.frozen == "stopped by a signal, state T", watch.frozen


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroup_frozen_worker_is_frozen_and_a_thawed_one_runs_on(watched, version):
    process, watch = watched
    with freezer(version) as group:
        group.add(process.pid)
        assert watch_for(watch, 0.6)[0] == {None}
        group.freeze()
        causes, _ = watch_for(watch, 30.0, until="frozen")
        assert "frozen" in causes and watch.frozen.startswith(f"frozen by its cgroup {group.path}"), watch.frozen
        group.thaw()
        stood = watch.counter.read()[2]
        end = time.monotonic() + 30
        while watch.counter.read()[2] == stood:
            assert time.monotonic() < end, "the thawed worker's count did not move again"
            time.sleep(0.02)
        assert kernel_state.frozen(process.pid) is None


def test_a_process_that_is_gone_or_exiting_is_not_frozen():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert kernel_state.frozen(process.pid) is None
    process.kill()
    process.wait()
    assert kernel_state.frozen(process.pid) is None  # reaped: nothing to read

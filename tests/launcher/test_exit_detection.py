"""The agent's early view of a dying worker (/proc), on real processes and real signals,
and the progress counters a killed agent left behind."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peerstate.launcher.processes import ExitWatch, remove_stale_counters
from peerstate.tools.local import wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def exit_in_progress(process: subprocess.Popen):
    watch = ExitWatch(process.pid)
    try:
        return watch.status()
    finally:
        watch.close()


def state(pid: int) -> bytes:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2:].split()[0]


def test_running_and_stopped_processes_are_not_exiting():
    process = python("import time; time.sleep(60)")
    try:
        assert exit_in_progress(process) is None
        process.send_signal(signal.SIGSTOP)
        wait_until(lambda: state(process.pid) == b"T", "the stop", 10, [])
        assert exit_in_progress(process) is None  # a hang is the progress timeout's business
    finally:
        process.kill()
        process.wait()


def test_killed_process_is_seen_before_it_is_reaped():
    # The status is read while the process is exiting or a zombie, never reaped by the
    # check itself: waitpid still reports the same death afterwards.
    process = python("import time; time.sleep(60)")
    try:
        process.send_signal(signal.SIGKILL)
        assert wait_until(lambda: exit_in_progress(process), "the death", 10, []) == -signal.SIGKILL
    finally:
        process.kill()
        assert process.wait() == -signal.SIGKILL


@pytest.mark.parametrize("code, expected", [(3, 3), (0, None)])
def test_exit_codes(code, expected):
    process = python(f"raise SystemExit({code})")
    try:
        wait_until(lambda: state(process.pid) == b"Z", "the exit", 30, [])
        assert exit_in_progress(process) == expected  # a clean exit is no failure
    finally:
        assert process.wait() == code


def test_one_open_watch_follows_the_process_to_its_end():
    process = python("import time; time.sleep(60)")
    watch = ExitWatch(process.pid)
    try:
        assert watch.status() is None
        process.send_signal(signal.SIGKILL)
        assert wait_until(watch.status, "the death", 10, []) == -signal.SIGKILL
        assert process.wait() == -signal.SIGKILL
        assert watch.status() is None  # reaped: the pid is gone
    finally:
        watch.close()
        process.kill()
        process.wait()


def test_reaped_process():
    process = python("pass")
    process.wait()
    assert exit_in_progress(process) is None


def test_the_counters_of_an_agent_killed_before_it_could_remove_them_are_removed(tmp_path):
    dead = python("pass")
    dead.wait()  # reaped: its pid names no process (an agent killed with SIGKILL)
    stale = [tmp_path / f"peerstate-{dead.pid}-n0.{k}.progress" for k in range(2)]
    live = tmp_path / f"peerstate-{os.getpid()}-n0.0.progress"  # another agent of this machine
    other = tmp_path / "peerstate-notes.progress"  # not a counter's name
    for path in (*stale, live, other):
        path.write_bytes(b"\0" * 24)
    assert remove_stale_counters(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])

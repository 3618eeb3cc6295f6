"""The agent's early view of a dying worker (/proc), on real processes and real signals."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peerstate.agent import exit_in_progress
from peerstate.local import wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def state(pid: int) -> bytes:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2:].split()[0]


def test_running_and_stopped_processes_are_not_exiting():
    process = python("import time; time.sleep(60)")
    try:
        assert exit_in_progress(process.pid) is None
        process.send_signal(signal.SIGSTOP)
        wait_until(lambda: state(process.pid) == b"T", "the stop", 10, [])
        assert exit_in_progress(process.pid) is None  # a hang is the progress timeout's business
    finally:
        process.kill()
        process.wait()


def test_killed_process_is_seen_before_it_is_reaped():
    # The status is read while the process is exiting or a zombie, never reaped by the
    # check itself: waitpid still reports the same death afterwards.
    process = python("import time; time.sleep(60)")
    try:
        process.send_signal(signal.SIGKILL)
        assert wait_until(lambda: exit_in_progress(process.pid), "the death", 10, []) == -signal.SIGKILL
    finally:
        process.kill()
        assert process.wait() == -signal.SIGKILL


@pytest.mark.parametrize("code, expected", [(3, 3), (0, None)])
def test_exit_codes(code, expected):
    process = python(f"raise SystemExit({code})")
    try:
        wait_until(lambda: state(process.pid) == b"Z", "the exit", 30, [])
        assert exit_in_progress(process.pid) == expected  # a clean exit is no failure
    finally:
        assert process.wait() == code


def test_unknown_process():
    process = python("pass")
    process.wait()
    assert exit_in_progress(process.pid) is None

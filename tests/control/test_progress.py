"""A worker's progress counter, read as its agent reads it, from a real worker-side
process: the Python heartbeat stands still while the interpreter is held (the GIL)
but the native liveness count goes on; a frozen process (SIGSTOP) stops both."""

import signal
import subprocess
import sys
import time

import pytest

from peerstate import InvalidArgumentError, _C
from peerstate.control import progress

TICKING = """
import sys, time
from peerstate.control.progress import ProgressCounter
counter = ProgressCounter(sys.argv[1])
counter.start_ticking(0.02)
print("ticking", flush=True)
sys.stdin.readline()
sys.setswitchinterval(30)  # hold the GIL: no other Python thread runs
until = time.monotonic() + float(sys.argv[2])
while time.monotonic() < until:
    pass
"""


def _advances(counter, word, seconds=0.5):
    before = counter.read()[word]
    time.sleep(seconds)
    return counter.read()[word] > before


@pytest.fixture
def worker(tmp_path):
    path = str(tmp_path / "worker.progress")
    progress.create(path)
    process = subprocess.Popen([sys.executable, "-c", TICKING, path, "60"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ticking\n"
        yield process, progress.ProgressCounter(path)
    finally:
        process.kill()
        process.wait()


def test_a_held_interpreter_stops_the_heartbeat_but_not_the_liveness_count(worker):
    process, counter = worker
    assert _advances(counter, 0) and _advances(counter, 2)
    process.stdin.write("hold\n")
    process.stdin.flush()
    time.sleep(0.3)  # the ticker's last wake-up before the hold
    assert not _advances(counter, 0) and _advances(counter, 2)


def test_a_frozen_process_stops_both(worker):
    process, counter = worker
    process.send_signal(signal.SIGSTOP)
    time.sleep(0.1)
    assert not _advances(counter, 0) and not _advances(counter, 2)
    process.send_signal(signal.SIGCONT)
    assert _advances(counter, 2)


def test_a_bad_word_is_refused_with_what_was_wrong(tmp_path):
    path = str(tmp_path / "short.progress")
    progress.create(path)
    with pytest.raises(InvalidArgumentError, match="multiple of 8"):
        _C.LivenessTicker(path, 4, 0.1)
    with pytest.raises(InvalidArgumentError, match="no 8-byte word at offset 24"):
        _C.LivenessTicker(path, 24, 0.1)
    with pytest.raises(InvalidArgumentError, match="at least 1 ms"):
        _C.LivenessTicker(path, 16, 0.0)
    ticker = _C.LivenessTicker(path, 16, 0.01)
    time.sleep(0.1)
    ticker.stop()
    stopped = ticker.count
    assert stopped > 0 and progress.ProgressCounter(path).read() == (0, -1, stopped)
    time.sleep(0.05)
    assert ticker.count == stopped

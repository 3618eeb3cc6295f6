"""A worker's progress counter, read as its agent reads it, from a real worker-side
process: the Python heartbeat stands still while the interpreter is held (the GIL)
but the native liveness count goes on; a frozen process (SIGSTOP) stops both."""

import re
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


def test_a_held_interpreter_prints_its_stacks_when_asked_and_runs_on(tmp_path):
    # What the agent asks of a worker whose heartbeat stopped (environment.STACKS_SIGNAL):
    # faulthandler answers from the signal, though the interpreter is held.
    from peerstate.control.environment import STACKS_SIGNAL

    path = str(tmp_path / "worker.progress")
    progress.create(path)
    log = tmp_path / "worker.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", TICKING, path, "60"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert process.stdout.readline() == "ticking\n"
        process.stdin.write("hold\n")
        process.stdin.flush()
        counter = progress.ProgressCounter(path)
        deadline = time.monotonic() + 30
        while _advances(counter, 0, 0.2):  # held: the heartbeat stands still
            assert time.monotonic() < deadline, "the interpreter was never held"
        process.send_signal(STACKS_SIGNAL)
        # faulthandler writes the dump piecemeal: wait for the held main thread's whole frame line
        while not re.search(r'File "<string>", line \d+ in <module>', log.read_text()):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert process.poll() is None  # it printed its stacks and runs on
    finally:
        process.kill()
        process.wait()


def test_a_frozen_process_stops_both(worker):
    process, counter = worker
    process.send_signal(signal.SIGSTOP)
    time.sleep(0.1)
    assert not _advances(counter, 0) and not _advances(counter, 2)
    process.send_signal(signal.SIGCONT)
    assert _advances(counter, 2)


DROPPING = """
import gc, sys, time
from peerstate.control.progress import ProgressCounter
counter = ProgressCounter(sys.argv[1])
counter.start_ticking(0.02)
counter.exiting()
counter.close()
del counter
gc.collect()  # what the interpreter's teardown does to it after an error left the loop
print("dropped", flush=True)
time.sleep(60)
"""


def test_the_liveness_count_ticks_on_after_the_interpreter_frees_it(tmp_path):
    # An exiting worker frees its ticker a second or more before the kernel ends it, under
    # load; a count that stopped there made a rank that raised look frozen (it was stopped,
    # held and reported as hung instead of as exited with its error).
    path = str(tmp_path / "worker.progress")
    progress.create(path)
    process = subprocess.Popen([sys.executable, "-c", DROPPING, path], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "dropped\n"
        counter = progress.ProgressCounter(path)
        assert _advances(counter, 2) and _advances(counter, 2)
    finally:
        process.kill()
        process.wait()


def test_a_bad_word_is_refused_with_what_was_wrong(tmp_path):
    path = str(tmp_path / "short.progress")
    progress.create(path)
    with pytest.raises(InvalidArgumentError, match="multiple of 8"):
        _C.LivenessTicker(path, 4, 0.1)
    with pytest.raises(InvalidArgumentError, match="no 8-byte word at offset 32"):
        _C.LivenessTicker(path, 32, 0.1)  # the file has four words
    with pytest.raises(InvalidArgumentError, match="at least 1 ms"):
        _C.LivenessTicker(path, 16, 0.0)
    ticker = _C.LivenessTicker(path, 16, 0.01)
    time.sleep(0.1)
    ticker.stop()
    stopped = ticker.count
    assert stopped > 0 and progress.ProgressCounter(path).read() == (0, -1, stopped)
    time.sleep(0.05)
    assert ticker.count == stopped


CLOSING = """
import sys, time
from peerstate.control.progress import ProgressCounter
counter = ProgressCounter(sys.argv[1])
counter.start_ticking(0.02)
counter.set_step(5)
print("ticking", flush=True)
sys.stdin.readline()
if sys.argv[2] == "exiting":
    counter.exiting()  # what Job.close() does
counter.close()
print("closed", flush=True)
time.sleep(60)  # a slow teardown
"""


def _watched(tmp_path, how):
    from peerstate.launcher.processes import WorkerProcess

    path = str(tmp_path / f"{how}.progress")
    progress.create(path)
    process = subprocess.Popen([sys.executable, "-c", CLOSING, path, how], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ticking\n"
    return process, WorkerProcess("n0.0", 0, process, progress.ProgressCounter(path), tmp_path / "log")


def _causes(watched, seconds, hang_timeout=0.3, join_timeout=30.0, freeze_timeout=30.0, until="never"):
    """What the agent's watch reads, every 20 ms, for ``seconds`` or until it reads ``until``."""
    seen = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end and until not in seen:
        seen.add(watched.read_progress(time.monotonic(), hang_timeout, join_timeout, freeze_timeout))
        time.sleep(0.02)
    return seen


@pytest.mark.parametrize("how", ["exiting", "stopped"])
def test_a_worker_that_closed_its_job_is_not_hung_while_it_exits_but_a_frozen_one_is(tmp_path, how):
    process, watched = _watched(tmp_path, how)
    try:
        assert _causes(watched, 0.3) == {None}  # stepping
        process.stdin.write("close\n")
        process.stdin.flush()
        assert process.stdout.readline() == "closed\n"
        if how == "stopped":  # a heartbeat that stops without the mark: a stalled interpreter
            assert "stalled" in _causes(watched, 1.0)
            return
        assert _causes(watched, 1.0) == {None}  # 3 x hang_timeout of teardown: bounded by join_timeout
        assert "stalled" in _causes(watched, 0.5, join_timeout=0.2)
        process.send_signal(signal.SIGSTOP)
        assert "frozen" in _causes(watched, 1.0)
    finally:
        process.kill()
        process.wait()
        watched.counter.close()
        watched.exit_watch.close()


def test_a_worker_that_exits_right_after_it_started_ticking_has_a_heartbeat(tmp_path):
    # The agent tells a script that failed after peerstate.Job() (a spare reading RANK before
    # track()) from one that never reached it by the first heartbeat, read after the exit. A
    # first heartbeat an interval later was missed by a process that died within it.
    path = str(tmp_path / "worker.progress")
    progress.create(path)
    quick = ("import sys\nfrom peerstate.control.progress import ProgressCounter\n"
             "ProgressCounter(sys.argv[1]).start_ticking(30.0)\nsys.exit(1)\n")
    assert subprocess.run([sys.executable, "-c", quick, path], timeout=60).returncode == 1
    counter = progress.ProgressCounter(path)
    assert counter.read()[0] > 0


def test_a_frozen_worker_is_found_by_the_freeze_bound_long_before_the_hang_bound(tmp_path):
    # --freeze-timeout bounds the native count alone: a held interpreter (its heartbeat
    # stopped, the GIL held) is not frozen, and is left to --hang-timeout; SIGSTOP is found
    # within the freeze bound though the hang bound is a minute.
    from peerstate.launcher.processes import WorkerProcess

    path = str(tmp_path / "worker.progress")
    progress.create(path)
    process = subprocess.Popen([sys.executable, "-c", TICKING, path, "2"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    watched = WorkerProcess("n0.0", 0, process, progress.ProgressCounter(path), tmp_path / "log")
    bounds = dict(hang_timeout=60.0, join_timeout=60.0, freeze_timeout=0.3)
    try:
        assert process.stdout.readline() == "ticking\n"
        watched.counter.set_step(5)
        assert _causes(watched, 0.3, **bounds) == {None}
        process.stdin.write("hold\n")
        process.stdin.flush()
        assert _causes(watched, 1.5, **bounds) == {None}  # held, not frozen
        process.send_signal(signal.SIGSTOP)
        # Found frozen, and never as stalled: the freeze bound found it before the hang bound could.
        assert _causes(watched, 30.0, until="frozen", **bounds) == {None, "frozen"}
    finally:
        process.kill()
        process.wait()
        watched.counter.close()
        watched.exit_watch.close()


def test_a_freeze_bound_under_three_ticks_is_refused():
    from peerstate.launcher.config import AgentConfig

    config = AgentConfig(script=["train.py"], nproc_per_node=1, freeze_timeout=0.1)
    with pytest.raises(InvalidArgumentError, match="--freeze-timeout 0.1 is too short.*at least"):
        config.validate()
    AgentConfig(script=["train.py"], nproc_per_node=1, freeze_timeout=0.3).validate()

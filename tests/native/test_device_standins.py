"""The device path's own sources, run against stand-ins (tests/native/cuda_standin):
- the CUDA device copy engine against a CUDA runtime stand-in: snapshots of
  device buffers spanning many chunks (many tickets in flight, events reused
  every version) ordered after the caller's stream, restore and its refusal of
  a corrupt version, an asynchronous copy error surfacing as CudaError, and
  nothing left behind at close;
- the nccl transport between two real processes over an NCCL stand-in loaded
  through peerstate's loader: a transfer, an abort in the middle of one, the
  sender killed in the middle of one, and a receiver that never comes.
Builds with a planted bug each show the checks catch what they are for.

What the stand-ins cannot show: DMA, pinned-memory limits, the concurrency of
real copy engines, NCCL's own transports and kernels (see their headers); those
run only on a GPU (bench/gpu/check.sh)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.native_build import cmake_build

pytestmark = pytest.mark.e2e  # a build of its own (~1 min of one core)

STANDIN = Path(__file__).resolve().parent / "cuda_standin"


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    return cmake_build(STANDIN, tmp_path_factory.mktemp("cuda_standin"))


def run(build: Path, driver: str, scenario: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(build / driver), scenario], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("scenario", ["snapshots", "restore", "stream_error", "close"])
def test_the_device_copy_engine_runs_its_paths_against_the_stand_in(drivers, scenario):
    result = run(drivers, "driver", scenario)
    assert result.returncode == 0 and result.stdout.strip() == f"PASS {scenario}", result.stdout + result.stderr


@pytest.mark.parametrize("driver, symptom", [
    ("driver_wrong_ticket", "was checksummed before its copy landed"),
    ("driver_unordered", "are not the bytes it held when the snapshot was taken"),
    ("driver_wrong_offset", "are not the bytes it held when the snapshot was taken"),
])
def test_a_planted_bug_in_the_engine_or_its_chunk_offsets_is_caught(drivers, driver, symptom):
    result = run(drivers, driver, "snapshots")
    assert result.returncode == 1 and symptom in result.stderr, result.stdout + result.stderr


def nccl_pair(build: Path, tmp_path: Path, driver: str, scenario: str, hold_after: int = 0):
    """Rank 0 (sender) and rank 1 (receiver) of ``scenario``; returns both processes,
    started, with their output going to files in ``tmp_path``. ``hold_after``: the
    sender stops after that many chunks landed, until its peer goes away."""
    env = dict(os.environ, PEERSTATE_NCCL_LIBRARY=str(build / "libnccl_standin.so"),
               PEERSTATE_NCCL_STANDIN_HOLD_AFTER=str(hold_after))
    idfile = tmp_path / "unique_id"
    processes = []
    for role in ("send", "recv"):
        out = open(tmp_path / f"{role}.out", "w")
        processes.append(subprocess.Popen([str(build / driver), role, scenario, str(idfile)], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + 60
        while role == "send" and not idfile.exists():  # rank 0 made the unique id
            assert processes[0].poll() is None and time.monotonic() < deadline, (tmp_path / "send.out").read_text()
            time.sleep(0.01)
    return processes


def output(tmp_path: Path, role: str) -> str:
    return (tmp_path / f"{role}.out").read_text()


@pytest.fixture
def pair(drivers, tmp_path):
    started = []

    def start(driver: str, scenario: str, hold_after: int = 0):
        started.extend(nccl_pair(drivers, tmp_path, driver, scenario, hold_after))
        return started

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def test_the_nccl_transport_moves_every_chunk_to_its_offset_between_two_processes(pair, tmp_path):
    sender, receiver = pair("nccl_driver", "transfer")
    assert receiver.wait(timeout=120) == 0 and sender.wait(timeout=120) == 0, output(tmp_path, "send") + \
        output(tmp_path, "recv")
    assert output(tmp_path, "recv").endswith("PASS\n")


def test_an_abort_in_the_middle_of_a_transfer_gives_every_chunk_back_and_fails_the_peer(pair, tmp_path):
    sender, receiver = pair("nccl_driver", "abort", hold_after=2)  # of 9 chunks
    assert receiver.wait(timeout=120) == 0, output(tmp_path, "recv")
    assert "FIRST" in output(tmp_path, "recv") and "RESULT 10 nccl transport aborted" in output(tmp_path, "recv")
    assert sender.wait(timeout=120) == 0, output(tmp_path, "send")
    assert "RESULT 11 " in output(tmp_path, "send") and "the communicator was aborted" in output(tmp_path, "send")


def test_a_sender_killed_in_the_middle_of_a_transfer_fails_the_receive_instead_of_hanging_it(pair, tmp_path):
    sender, receiver = pair("nccl_driver", "killed", hold_after=2)
    deadline = time.monotonic() + 120
    while "FIRST" not in output(tmp_path, "recv"):
        assert receiver.poll() is None and time.monotonic() < deadline, output(tmp_path, "recv")
        time.sleep(0.01)
    os.kill(sender.pid, signal.SIGKILL)
    assert sender.wait(timeout=30) == -signal.SIGKILL
    assert receiver.wait(timeout=120) == 0, output(tmp_path, "recv")
    assert "RESULT 11 nccl communicator failed" in output(tmp_path, "recv")  # kConnectionError, and aborted


def test_a_receiver_that_never_comes_times_the_send_out_and_aborts_it(pair, tmp_path):
    sender, receiver = pair("nccl_driver", "timeout")
    assert sender.wait(timeout=120) == 0, output(tmp_path, "send")
    assert "RESULT 9 nccl transfer did not finish within 3000 ms" in output(tmp_path, "send")
    assert receiver.poll() is None  # it never received: the test ends it


def test_a_planted_bug_in_the_nccl_transports_chunk_offsets_is_caught(pair, tmp_path):
    sender, receiver = pair("nccl_driver_wrong_offset", "transfer")
    assert receiver.wait(timeout=120) == 1 and "bytes differ from what was sent" in output(tmp_path, "recv")
    sender.wait(timeout=120)

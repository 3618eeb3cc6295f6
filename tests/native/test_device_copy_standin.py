"""The CUDA device copy engine's own source, run against a CUDA runtime stand-in
(tests/native/cuda_standin): snapshots of device buffers spanning many chunks
(many tickets in flight, events reused every version) ordered after the
caller's stream, restore and its refusal of a corrupt version, an asynchronous
copy error surfacing as CudaError, and nothing left behind at close. Three
builds with a planted bug each show the checks catch what they are for.

What the stand-in cannot show: DMA, pinned-memory limits, the concurrency of
real copy engines, contexts (see its header); those run only on a GPU
(bench/gpu/check.sh)."""

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a build of its own (~40 s of one core)

STANDIN = Path(__file__).resolve().parent / "cuda_standin"


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    assert shutil.which("cmake"), "cmake is needed to build the stand-in tests (see the README's requirements)"
    build = tmp_path_factory.mktemp("cuda_standin")
    for command in (["cmake", "-S", str(STANDIN), "-B", str(build)], ["cmake", "--build", str(build), "-j2"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return build


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

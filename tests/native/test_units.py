"""The core's C++ unit tests (tests/native/units: checksums, layout, version
metadata, replica version rules, wire frames, the parity fold), built from the core's own sources
with AddressSanitizer and UndefinedBehaviorSanitizer, and run; and a socket's
shutdown() racing its owner's close(), under ThreadSanitizer. GoogleTest comes
from Debian's libgtest-dev, which the README's test command installs: without it
the tests are skipped, except under CI, where that is a failure. A build with a
bounds check planted out of the metadata decoder shows the pair catches an
over-read; one with shutdown()'s guard planted out, that ThreadSanitizer catches
the race."""

import re
import subprocess
from pathlib import Path

import pytest

from helpers.native_build import cmake_build
from helpers.system import missing

pytestmark = pytest.mark.e2e  # a build of its own (~40 s of two cores)

UNITS = Path(__file__).resolve().parent / "units"


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    def without_gtest(output: str) -> None:
        if "GTest" in output:
            missing("GoogleTest", "Debian: apt-get install libgtest-dev")

    return cmake_build(UNITS, tmp_path_factory.mktemp("units"), without_gtest)


def test_the_cores_unit_tests_pass_under_the_sanitizers(build):
    result = subprocess.run([str(build / "units"), "--gtest_brief=1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-8000:]
    # Every test ran: none skipped for want of libcrypto, and not an empty run.
    passed = re.search(r"\[  PASSED  \] (\d+) tests?\.", result.stdout)
    assert passed and int(passed.group(1)) >= 38 and "SKIPPED" not in result.stdout, result.stdout[-4000:]


def test_a_planted_over_read_is_caught(build):
    result = subprocess.run([str(build / "units_planted_overread"), "--gtest_filter=VersionMeta.*"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stdout[-4000:] + result.stderr[-4000:]
    assert "decode_meta" in result.stderr, result.stderr[-4000:]


def test_a_sockets_shutdown_from_another_thread_is_serialised_with_its_close(build):
    # A server's stop() shuts a connection down while the connection's thread may be
    # closing it: unserialised, the shutdown can reach a descriptor number the process
    # has already given to another socket.
    result = subprocess.run([str(build / "socket_race"), "--gtest_brief=1"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert "[  PASSED  ] 2 tests." in result.stdout, result.stdout[-4000:]
    planted = subprocess.run([str(build / "socket_race_planted_unguarded"), "--gtest_brief=1"],
                             capture_output=True, text=True, timeout=300)
    assert planted.returncode != 0
    assert "ThreadSanitizer: data race" in planted.stderr, planted.stdout[-4000:] + planted.stderr[-4000:]
    assert "Socket::shutdown" in planted.stderr and "Socket::close" in planted.stderr, planted.stderr[-4000:]

"""The core's layers are enforced by the build, not only read by a test
(tests/test_layering.py): each layer's library compiles against the directories
it may include, so an include that goes up the layers fails. A copy of the
source tree with one planted (store/ including net/) fails to build its layer,
and builds once the plant is taken out."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a configure and a build of one layer (~30 s of two cores)

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
PLANTED = '#include "net/socket.h"  // planted: store/ may not include net/\n'


def build_store_layer(build):
    return subprocess.run(["cmake", "--build", str(build), "--target", "peerstate_store", "-j2"], capture_output=True,
                          text=True, timeout=600)


def test_an_include_that_goes_up_the_layers_fails_the_build(tmp_path):
    assert shutil.which("cmake"), "cmake is needed to build the native tests (see the README's requirements)"
    pybind11 = pytest.importorskip("pybind11")
    source, build = tmp_path / "src", tmp_path / "build"
    source.mkdir()
    shutil.copy(REPO / "CMakeLists.txt", source)
    shutil.copytree(CSRC, source / "csrc")
    layout = source / "csrc" / "store" / "layout.cc"
    original = layout.read_text()
    layout.write_text(PLANTED + original)
    configure = subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), "-DPEERSTATE_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Debug",
         f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"],
        capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout[-4000:] + configure.stderr[-4000:]

    planted = build_store_layer(build)
    assert planted.returncode != 0, "a store/ source including net/ built"
    assert "net/socket.h" in planted.stdout + planted.stderr, planted.stdout[-4000:] + planted.stderr[-4000:]

    layout.write_text(original)
    clean = build_store_layer(build)
    assert clean.returncode == 0, clean.stdout[-4000:] + clean.stderr[-4000:]

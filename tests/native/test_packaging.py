"""The wheel: builds from the source tree, installs into a fresh venv, imports without torch,
numpy, CUDA or a GPU, and needs no CUDA or NCCL library at load time."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def venv_with_wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")],
        check=True, timeout=900, capture_output=True,
    )
    wheels = list((tmp / "dist").glob("peerstate-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheels[0])],
                   check=True, timeout=300, capture_output=True)
    return python, tmp


@pytest.mark.e2e
def test_imports_in_fresh_venv_from_outside_the_repo(venv_with_wheel):
    python, tmp = venv_with_wheel
    script = textwrap.dedent(
        """
        import ctypes, sys
        import peerstate
        assert "torch" not in sys.modules and "numpy" not in sys.modules, "import must stay light"
        assert peerstate.__file__.startswith(sys.prefix), peerstate.__file__
        buf = (ctypes.c_ubyte * 4096)(*[i % 251 for i in range(4096)])
        store = peerstate._C.SnapshotStore()
        store.register_buffers([peerstate._C.BufferRegistration("b", ctypes.addressof(buf), 4096)])
        store.snapshot(1); store.wait()
        ctypes.memset(buf, 0, 4096)
        store.restore(1)
        assert bytes(buf) == bytes(i % 251 for i in range(4096))
        store.close()
        print(peerstate.cuda_compiled(), peerstate.cuda_available())
        """
    )
    out = subprocess.run([str(python), "-I", "-c", script], cwd=tmp, check=True, timeout=120,
                         capture_output=True, text=True).stdout.split()
    compiled, available = out[-2:]
    if shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc"):
        if os.environ.get("PEERSTATE_CUDA", "AUTO").upper() != "OFF":
            assert compiled == "True", "nvcc is installed, so AUTO must build the CUDA sources"
    assert available in ("True", "False")


def test_extension_needs_no_cuda_or_nccl_library(venv_with_wheel):
    python, _ = venv_with_wheel
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    site = subprocess.run([str(python), "-c", "import peerstate._C as c; print(c.__file__)"],
                          check=True, capture_output=True, text=True, cwd="/").stdout.strip()
    dynamic = subprocess.run(["readelf", "-d", site], check=True, capture_output=True, text=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert needed, dynamic
    for lib in needed:
        assert not lib.startswith(("libcudart", "libcuda", "libnccl", "libtorch", "libc10")), needed

"""Loading libnccl at run time, tested without a GPU: absent, too old, incomplete.
The transfer test needs two GPUs and is skipped, visibly, elsewhere."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import peerstate
from peerstate import _C


def load_in_subprocess(env_extra, tmp_path):
    code = textwrap.dedent("""
        import peerstate
        try:
            print("OK", peerstate._C.nccl_load())
        except peerstate.UnavailableError as e:
            print("UNAVAILABLE", e)
    """)
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path).stdout.strip()


def fake_nccl(tmp_path, version, missing=None):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build a stand-in libnccl")
    symbols = ["ncclGetUniqueId", "ncclCommInitRank", "ncclCommAbort", "ncclCommDestroy", "ncclCommGetAsyncError",
               "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd"]
    body = f"int ncclGetVersion(int* v) {{ *v = {version}; return 0; }}\n"
    body += "const char* ncclGetErrorString(int r) { return \"fake\"; }\n"
    body += "".join(f"int {s}() {{ return 1; }}\n" for s in symbols if s != missing)
    src = tmp_path / f"fake{version}{missing}.c"
    src.write_text(body)
    lib = tmp_path / f"libfakenccl{version}{missing}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    return str(lib)


@pytest.mark.skipif(peerstate.cuda_available(), reason="a GPU machine may well have NCCL")
def test_missing_nccl_is_a_clear_error(tmp_path):
    out = load_in_subprocess({"PEERSTATE_NCCL_LIBRARY": ""}, tmp_path)
    assert out.startswith("UNAVAILABLE NCCL not found"), out
    assert "libnccl.so.2" in out and "PEERSTATE_NCCL_LIBRARY" in out


def test_explicit_path_that_does_not_exist(tmp_path):
    out = load_in_subprocess({"PEERSTATE_NCCL_LIBRARY": str(tmp_path / "nope.so")}, tmp_path)
    assert out.startswith("UNAVAILABLE PEERSTATE_NCCL_LIBRARY=") and "could not be loaded" in out, out


def test_too_old_nccl_is_named(tmp_path):
    out = load_in_subprocess({"PEERSTATE_NCCL_LIBRARY": fake_nccl(tmp_path, 21005)}, tmp_path)
    assert "found NCCL 2.10.5" in out and "needs NCCL >= 2.18.0" in out, out


def test_incomplete_nccl_names_the_missing_symbol(tmp_path):
    out = load_in_subprocess({"PEERSTATE_NCCL_LIBRARY": fake_nccl(tmp_path, 22105, missing="ncclSend")}, tmp_path)
    assert "lacks ncclSend" in out, out


def test_good_enough_nccl_loads(tmp_path):
    out = load_in_subprocess({"PEERSTATE_NCCL_LIBRARY": fake_nccl(tmp_path, 22105)}, tmp_path)
    assert out.startswith("OK") and "'version': '2.21.5'" in out, out


@pytest.mark.skipif(peerstate.cuda_available(), reason="a GPU machine may well have NCCL")
def test_store_wiring_fails_cleanly_without_nccl(tmp_path):
    code = textwrap.dedent("""
        import peerstate, peerstate.replication.nccl
        class Store(dict):
            def set(self, k, v): self[k] = v
            def get(self, k): return self[k]
        store = Store()
        try:
            peerstate.replication.nccl.nccl_transport(store, 0, 2, 0)
        except peerstate.UnavailableError as e:
            print("UNAVAILABLE", e, "| keys:", sorted(store))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PEERSTATE_NCCL_LIBRARY=""),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path).stdout.strip()
    assert out.startswith("UNAVAILABLE NCCL not found") and out.endswith("| keys: []"), out


@pytest.mark.skipif(peerstate.cuda_compiled(), reason="checks the host-only build's answer")
def test_host_only_build_has_no_nccl_transport():
    with pytest.raises(peerstate.UnavailableError, match="no CUDA support"):
        _C.nccl_transport(b"\0" * 128, 2, 0, 0)


@pytest.mark.skipif(_C.cuda_device_count() < 2, reason="the nccl transfer test needs 2 GPUs "
                    f"(this machine has {_C.cuda_device_count()})")
def test_nccl_transfer_between_two_gpus(tmp_path):
    script = tmp_path / "nccl_pair.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, peerstate
        from peerstate import _C
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        import peerstate.replication.nccl
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=True)
        torch.cuda.set_device(rank)
        transport = peerstate.replication.nccl.nccl_transport(store, rank, 2, rank)
        n = 64 << 20
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=torch.Generator("cuda").manual_seed(3)) \\
            if rank == 0 else torch.zeros(n, dtype=torch.uint8, device="cuda")
        host = peerstate.SnapshotStore(chunk_bytes=4 << 20)
        host.register("b", buf)
        host.snapshot(1).wait()
        meta = host.version_info(1)
        if rank == 0:
            transport.send_region(1, meta, buf.data_ptr())
        else:
            transport.receive_region(0, meta, buf.data_ptr())
            expected = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
            assert torch.equal(buf, expected)
        print("done", rank)
    """))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)]) for r in range(2)]
    try:
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()


def nvidia_nccl_library() -> str:
    """libnccl.so.2 of NVIDIA's nvidia-nccl-cu12 wheel (the test extra installs it)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-nccl-cu12 is not installed (pip install nvidia-nccl-cu12, or the test extra)")
    return os.path.join(list(spec.submodule_search_locations)[0], "lib", "libnccl.so.2")


def test_the_real_libnccl_loads_through_our_loader_and_fails_clearly_without_a_device(tmp_path):
    library = nvidia_nccl_library()
    code = textwrap.dedent("""
        import ctypes, sys
        import peerstate
        from peerstate import _C
        loaded = _C.nccl_load()
        direct = ctypes.c_int()
        ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(direct))  # the library's own answer, not ours
        print("LOADED", loaded["version_code"], direct.value, loaded["origin"])
        print("UNIQUE_ID", len(_C.nccl_unique_id()))  # a bootstrap address: no device needed
        try:
            _C.nccl_transport(_C.nccl_unique_id(), 2, 0, 0, 2000)
            print("TRANSPORT made")
        except peerstate.Error as e:
            print("TRANSPORT", type(e).__name__, e)
    """)
    result = subprocess.run([sys.executable, "-c", code, library], env=dict(os.environ, PEERSTATE_NCCL_LIBRARY=library),
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr  # no crash
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    ours, theirs, origin = lines["LOADED"].split(" ", 2)
    assert int(ours) == int(theirs) >= 21800 and origin == library  # every symbol bound (else: "lacks ...")
    assert lines["UNIQUE_ID"] == "128"
    if peerstate.cuda_available():
        pytest.skip("this machine has a GPU: the transport's device path is bench/gpu/check.sh's")
    expected = "UnavailableError cannot use CUDA device 0" if peerstate.cuda_compiled() else \
        "UnavailableError this build has no CUDA"
    assert lines["TRANSPORT"].startswith(expected), lines["TRANSPORT"]

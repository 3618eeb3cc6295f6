"""The snapshot store through its public API, on host memory."""

import time
import warnings

import numpy as np
import pytest
import torch

import peerstate
from peerstate import _C, _probes

ODD_SIZES = [1, 3, 7, 63, 64, 65, 4095, 4097, 65_537, (1 << 20) + 13]


def fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g))


def byte_tensor(n: int, seed: int) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.uint8)
    fill(t, seed)
    return t


def test_round_trip_odd_zero_and_large_sizes(store):
    tensors = {f"b{n}": byte_tensor(n, n) for n in ODD_SIZES}
    tensors["empty"] = torch.empty(0)
    tensors["large"] = byte_tensor((64 << 20) + 5, 99)  # spans ~1000 chunks of 64 KiB
    store.register_many(tensors)
    expected = {k: v.clone() for k, v in tensors.items()}
    store.snapshot(1).wait()
    for k, v in tensors.items():
        if v.numel():
            v.view(torch.uint8).fill_(0xAB)
    store.restore(1)
    for k, v in tensors.items():
        assert torch.equal(v, expected[k]), k


def test_many_small_buffers():
    store = peerstate.SnapshotStore(threads=2)  # default 4 MiB chunks: ~64 buffers per chunk
    try:
        tensors = {f"p{i}": torch.full((16384 + (i % 3),), float(i)) for i in range(3000)}
        store.register_many(tensors)
        info_before = {k: v.clone() for k, v in tensors.items()}
        store.snapshot(5).wait()
        info = store.version_info(5)
        assert len(info["buffers"]) == 3000
        assert len(info["chunks"]) < 3000 / 10  # packed, not one chunk per buffer
        for v in tensors.values():
            v.add_(1)
        store.restore(5)
        assert all(torch.equal(tensors[k], info_before[k]) for k in tensors)
    finally:
        store.close()


def all_dtypes():
    """Every dtype torch exposes that it can hold in a dense CPU tensor whose bytes can be
    written (sub-byte dtypes cannot be created; deprecated quantized ones refuse byte copies)."""
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    usable = []
    warnings.filterwarnings("ignore", message=".*(ComplexHalf|quantized).*")
    for dtype in sorted(found, key=str):
        try:
            fill(torch.empty(4, dtype=dtype), 0)
        except (RuntimeError, TypeError):
            continue
        usable.append(dtype)
    return usable


def test_dtype_list_covers_the_common_ones():
    names = {str(d) for d in all_dtypes()}
    for n in ("float32", "bfloat16", "float16", "float64", "complex64", "int8", "uint8", "int64", "bool",
              "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        assert f"torch.{n}" in names


@pytest.mark.parametrize("dtype", all_dtypes(), ids=str)
def test_every_dtype_bitwise(store, dtype):
    t = torch.empty(1001, dtype=dtype)
    fill(t, 7)  # random bit patterns, NaN payloads included: compared as bytes
    before = t.view(torch.uint8).clone()
    store.register("t", t)
    store.snapshot(1).wait()
    fill(t, 8)
    assert not torch.equal(t.view(torch.uint8), before)
    store.restore(1)
    assert torch.equal(t.view(torch.uint8), before)


def test_numpy_and_buffer_protocol(store):
    a = np.arange(12345, dtype=np.float64)
    b = bytearray(b"peerstate" * 100)
    store.register_many({"a": a, "b": b})
    store.snapshot(3).wait()
    a[:] = -1
    b[:9] = b"xxxxxxxxx"
    store.restore(3)
    assert np.array_equal(a, np.arange(12345, dtype=np.float64))
    assert bytes(b) == b"peerstate" * 100


def test_restore_older_version_after_changes(store):
    t = byte_tensor(300_000, 1)
    store.register("t", t)
    v1 = t.clone()
    store.snapshot(1).wait()
    fill(t, 2)
    v2 = t.clone()
    store.snapshot(2).wait()
    assert store.committed_versions() == [1, 2]
    fill(t, 3)
    store.restore(2)
    assert torch.equal(t, v2)
    store.restore(1)  # rolls back: version 2 is dropped
    assert torch.equal(t, v1)
    assert store.committed_versions() == [1]
    fill(t, 4)
    store.snapshot(2).wait()  # the dropped step number can be taken again
    assert store.committed_versions() == [1, 2]


def test_restore_committed_while_newer_in_flight():
    store = peerstate.SnapshotStore(threads=1, chunk_bytes=1 << 20)
    try:
        t = byte_tensor(256 << 20, 1)
        store.register("t", t)
        store.snapshot(1).wait()
        v1_head = t[:1 << 20].clone()
        v1_crc = _probes.crc32c(t.numpy())
        t[: 1 << 20].fill_(7)
        handle = store.snapshot(2)  # 256 MiB on one thread: tens of milliseconds
        assert store.in_flight_version() == 2
        assert store.committed_versions() == [1]  # the last committed version is intact meanwhile
        store.restore(1)  # cancels 2: it would read buffers being overwritten
        assert torch.equal(t[:1 << 20], v1_head) and _probes.crc32c(t.numpy()) == v1_crc
        assert store.committed_versions() == [1]
        assert handle.done()
    finally:
        store.close()


def test_version_in_flight_is_not_restorable_and_commits_only_when_done():
    store = peerstate.SnapshotStore(threads=1, chunk_bytes=1 << 20)
    try:
        store.register("t", byte_tensor(128 << 20, 1))
        store.snapshot(1)
        if store.in_flight_version() == 1:
            assert store.committed_versions() == []
            with pytest.raises(peerstate.NotFoundError, match="still in flight"):
                store.restore(1)
        store.wait()
        assert store.committed_versions() == [1]
    finally:
        store.close()


def test_corrupted_snapshot_detected_and_live_untouched(store):
    t = byte_tensor(200_000, 1)
    store.register("t", t)
    store.snapshot(1).wait()
    good = t.clone()
    store.snapshot(2).wait()
    fill(t, 9)
    live = t.clone()
    info = store.version_info(2)
    raw = store.stored_bytes(2)
    offset = info["chunks"][1][0] + 10
    raw[offset] ^= 0x01  # a single flipped bit in host memory
    with pytest.raises(peerstate.ChecksumMismatchError, match=r"version 2 is corrupt: chunk 1 .*'t'"):
        store.restore(2)
    assert torch.equal(t, live)
    assert store.committed_versions() == [1, 2]
    store.restore(1)
    assert torch.equal(t, good)


def test_restore_writes_only_the_chunks_that_differ(store):
    # chunk_bytes is 64 KiB here: "a" spans 4 chunks, "b" and "c" one each.
    a, b, c = byte_tensor(4 * 65536, 1), byte_tensor(65536, 2), byte_tensor(65536, 3)
    store.register_many({"a": a, "b": b, "c": c})
    store.snapshot(1).wait()
    saved = [t.clone() for t in (a, b, c)]
    assert store.restore(1) == 0  # nothing changed: nothing written
    a[65536 + 5] ^= 0xFF  # the second chunk of "a"
    fill(c, 7)
    assert store.restore(1) == 2 * 65536
    assert all(torch.equal(t, s) for t, s in zip((a, b, c), saved))


def test_restore_keeps_a_version_that_committed_before_anyone_waited(store):
    t = byte_tensor(300_000, 1)
    store.register("t", t)
    store.snapshot(1)
    while store.in_flight_version() is not None:  # committed; wait() never called
        time.sleep(0.001)
    store.restore(1)
    assert store.committed_versions() == [1]
    store.restore(1)


def test_corrupt_chunk_is_refused_even_where_the_rest_is_unchanged(store):
    # A chunk equal to the live bytes is skipped unverified; a corrupted one no longer is.
    t = byte_tensor(3 * 65536, 1)
    store.register("t", t)
    store.snapshot(1).wait()
    live = t.clone()
    store.stored_bytes(1)[store.version_info(1)["chunks"][2][0] + 3] ^= 0x10
    with pytest.raises(peerstate.ChecksumMismatchError, match=r"version 1 is corrupt: chunk 2 "):
        store.restore(1)
    assert torch.equal(t, live)


def test_restore_without_verify_skips_the_checksum_pass(store):
    # verify=False is for a version received a moment ago and verified chunk by chunk on
    # arrival; the same flipped bit that restore() refuses is then copied as it is.
    t = byte_tensor(200_000, 1)
    store.register("t", t)
    store.snapshot(1).wait()
    raw = store.stored_bytes(1)
    offset = store.version_info(1)["chunks"][1][0] + 10
    raw[offset] ^= 0x01
    expected = torch.frombuffer(bytearray(bytes(raw)), dtype=torch.uint8)[: t.numel()]
    with pytest.raises(peerstate.ChecksumMismatchError):
        store.restore(1)
    store.restore(1, verify=False)
    assert torch.equal(t.view(torch.uint8)[: expected.numel()], expected)


def test_unknown_version(store):
    t = byte_tensor(1000, 1)
    store.register("t", t)
    store.snapshot(4).wait()
    with pytest.raises(peerstate.NotFoundError, match=r"version 3 is not a committed snapshot \(committed: 4\)"):
        store.restore(3)
    with pytest.raises(LookupError):  # also a LookupError for callers that catch builtins
        store.restore(5)


def test_registration_changed_size_is_refused_and_live_untouched(store):
    t = byte_tensor(1000, 1)
    store.register("t", t)
    store.snapshot(1).wait()
    bigger = byte_tensor(2000, 2)
    store.register("t", bigger)  # explicitly re-registered with another size
    before = bigger.clone()
    with pytest.raises(peerstate.RegistrationMismatchError, match="'t' had 1000 bytes and now has 2000"):
        store.restore(1)
    assert torch.equal(bigger, before)


def test_registration_changed_names_is_refused(store):
    a, b = byte_tensor(10, 1), byte_tensor(10, 2)
    store.register("a", a)
    store.snapshot(1).wait()
    store.register("b", b)
    with pytest.raises(peerstate.RegistrationMismatchError, match="holds 1 buffers, the registration has 2"):
        store.restore(1)
    store.unregister("b")
    store.restore(1)


def test_tensor_resized_in_place_is_detected(store):
    t = torch.zeros(1000)
    store.register("t", t)
    store.snapshot(1).wait()
    t.resize_(1_000_000)  # reallocates: the registered pointer is gone
    with pytest.raises(peerstate.RegistrationMismatchError, match="'t' no longer matches"):
        store.snapshot(2)
    with pytest.raises(peerstate.RegistrationMismatchError, match="'t' no longer matches"):
        store.restore(1)


def test_byte_ranges_of_one_tensor_in_two_stores_restore_their_own_bytes():
    # How a data-parallel share cuts a large tensor: each store holds one part.
    t = torch.arange(10_000, dtype=torch.float32)
    first, second = peerstate.SnapshotStore(), peerstate.SnapshotStore()
    first.register("t[0:16384]", peerstate.ByteRange(t, 0, 16384))
    second.register("t[16384:40000]", peerstate.ByteRange(t, 16384, 40000 - 16384))
    first.snapshot(1).wait()
    second.snapshot(1).wait()
    t.fill_(-1)
    first.restore(1)
    assert torch.equal(t[:4096], torch.arange(4096, dtype=torch.float32)) and bool((t[4096:] == -1).all())
    second.restore(1)
    assert torch.equal(t, torch.arange(10_000, dtype=torch.float32))
    t.resize_(1_000_000)  # reallocates: the whole tensor is watched, not only the range
    with pytest.raises(peerstate.RegistrationMismatchError, match=r"'t\[16384:40000\]' no longer matches"):
        second.snapshot(2)
    for store in (first, second):
        store.close()


@pytest.mark.parametrize("offset, nbytes", [(-4, 8), (0, 0), (36, 8)])
def test_a_byte_range_outside_its_tensor_is_refused(store, offset, nbytes):
    with pytest.raises(peerstate.InvalidArgumentError, match="not a non-empty range inside its 40 bytes"):
        store.register("x", peerstate.ByteRange(torch.zeros(10), offset, nbytes))
    assert store.registered() == []


def test_a_tensor_resized_deep_in_a_large_registration_fails_the_version_and_keeps_the_last(store):
    # 3 batches of the registration check: the copy of the first ones is under
    # way when the check reaches the resized tensor, and all of it is dropped.
    tensors = {f"t{i:04}": byte_tensor(4096, i) for i in range(700)}
    store.register_many(tensors)
    store.register("objects_neighbour", np.arange(10, dtype=np.int64))
    store.snapshot(1).wait()
    expected = {n: t.clone() for n, t in tensors.items()}
    for t in tensors.values():
        fill(t, 7)
    tensors["t0600"].resize_(1 << 20)
    with pytest.raises(peerstate.RegistrationMismatchError, match="'t0600' no longer matches"):
        store.snapshot(2)
    assert store.in_flight_version() is None
    assert store.committed_versions() == [1]
    store.register("t0600", tensors["t0600"])
    with pytest.raises(peerstate.RegistrationMismatchError):
        store.restore(1)  # the new registration has other sizes: version 1 cannot go back in
    tensors["t0600"].resize_(4096)
    store.register("t0600", tensors["t0600"])
    store.restore(1)
    for n, t in tensors.items():
        assert torch.equal(t, expected[n]), n
    store.snapshot(2).wait()
    assert store.committed_versions() == [1, 2]


def test_a_gated_version_copies_only_what_was_validated():
    store = _C.SnapshotStore(threads=2, chunk_bytes=4096)
    buffers = [np.full(4096, i, dtype=np.uint8) for i in range(8)]
    empty = [_C.BufferRegistration("empty", 0, 0)]  # no chunk, but counted in the layout order
    store.register_buffers(empty + [_C.BufferRegistration(f"b{i}", b.ctypes.data, b.nbytes) for i, b in enumerate(buffers)])
    assert store.buffer_names() == ["empty"] + [f"b{i}" for i in range(8)]
    store.snapshot(1, gated=True)
    store.validated(5)
    time.sleep(0.2)
    assert store.in_flight_version() == 1  # buffers 5..8 are not validated: not copied, not committed
    store.validated(3)  # counts only grow
    store.validated(9)
    store.wait()
    assert store.committed_versions() == [1]
    stored = np.frombuffer(store.stored_bytes(1), dtype=np.uint8)
    for i in range(8):
        assert (stored[i * 4096 : (i + 1) * 4096] == i).all()


def test_a_gated_version_waited_for_before_validation_is_cancelled_not_hung():
    store = _C.SnapshotStore(threads=2, chunk_bytes=4096)
    buffer = np.zeros(1 << 16, dtype=np.uint8)
    store.register_buffers([_C.BufferRegistration("b", buffer.ctypes.data, buffer.nbytes)])
    store.snapshot(1)
    store.wait()
    store.snapshot(2, gated=True)
    with pytest.raises(peerstate.InvalidArgumentError, match="before all its buffers were validated"):
        store.wait()
    store.snapshot(3, gated=True)
    store.cancel()
    assert store.in_flight_version() is None
    assert store.committed_versions() == [1]
    store.restore(1)


def test_budget_exceeded_at_registration_keeps_previous_registration():
    store = peerstate.SnapshotStore(budget_bytes=1 << 20)
    try:
        small = byte_tensor(1000, 1)
        store.register("small", small)
        with pytest.raises(peerstate.BudgetExceededError, match="over the budget of 1048576 bytes"):
            store.register("big", byte_tensor(600_000, 2))  # 2 versions x 600 KB > 1 MiB
        assert store.registered() == ["small"]
        assert store.memory()["registered_bytes"] == 1000
        store.snapshot(1).wait()
    finally:
        store.close()


@pytest.mark.parametrize(
    "obj, message",
    [
        (torch.zeros(10, 10).t(), "not contiguous"),
        (np.zeros(10)[::2], "not C-contiguous"),
        (np.frombuffer(b"abcdefgh", dtype=np.uint8), "read-only"),
        (b"immutable bytes", "read-only"),
        (object(), "cannot register 'x' of type object"),
        (torch.zeros(3, 3).to_sparse(), "layout"),
    ],
)
def test_bad_buffers(store, obj, message):
    with pytest.raises(peerstate.InvalidArgumentError, match=message):
        store.register("x", obj)
    assert store.registered() == []


def test_bad_arguments(store):
    with pytest.raises(peerstate.InvalidArgumentError, match="max_versions must be at least 2"):
        peerstate.SnapshotStore(max_versions=1)
    with pytest.raises(peerstate.InvalidArgumentError, match="nothing is registered"):
        store.snapshot(1)
    with pytest.raises(peerstate.InvalidArgumentError, match="appears twice"):
        store.native.register_buffers([_C.BufferRegistration("a", 1, 0), _C.BufferRegistration("a", 1, 0)])
    with pytest.raises(peerstate.InvalidArgumentError, match="null pointer"):
        store.native.register_buffers([_C.BufferRegistration("a", 0, 10)])
    with pytest.raises(peerstate.NotFoundError, match="not registered: 'nope'"):
        store.unregister("nope")
    t = byte_tensor(10, 1)
    store.register("t", t)
    store.snapshot(5).wait()
    with pytest.raises(peerstate.InvalidArgumentError, match="not newer than committed version 5"):
        store.snapshot(5)


@pytest.mark.skipif(peerstate.cuda_available(), reason="checks the no-GPU error path")
def test_device_buffer_without_gpu_is_a_clear_error(store):
    with pytest.raises(peerstate.UnavailableError, match="cannot register device buffer 'w'"):
        store.native.register_buffers([_C.BufferRegistration("w", 0x1000, 64, device=0)])
    assert store.registered() == []


def test_memory_report(store):
    store.register_many({"a": byte_tensor(1000, 1), "b": byte_tensor(100, 2)})
    m = store.memory()
    assert m["registered_bytes"] == 1100
    assert m["bytes_per_version"] >= 1100 and m["held_bytes"] == 0
    store.snapshot(1).wait()
    store.snapshot(2).wait()
    m = store.memory()
    assert [v for v, _ in m["versions"]] == [1, 2]
    assert m["held_bytes"] == sum(n for _, n in m["versions"]) >= 2 * 1100


@pytest.mark.parametrize("checksums", [True, False])
def test_stored_bytes_and_checksums_at_every_alignment(checksums):
    # Sources at every offset mod 16 and sizes around the copy kernels' lane
    # boundaries (blocks of 4 x 4096 bytes, then 3 x 256, then words): the
    # stored bytes equal the sources, and each chunk's checksum, computed as the
    # bytes were copied, equals a software CRC32C of what was stored.
    rng = np.random.default_rng(7)
    backing = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    sizes = [16384 * 3 + 768 + 13, 16384, 16383, 4096 + 1, 769, 4097 + 16384]
    buffers = {f"s{i}": backing[i * 40000 + i : i * 40000 + i + n] for i, n in enumerate(sizes * 3)}
    store = peerstate.SnapshotStore(threads=2, chunk_bytes=64 * 1024, checksums=checksums)
    try:
        store.register_many(buffers)
        store.snapshot(1).wait()
        info = store.version_info(1)
        stored = np.frombuffer(store.stored_bytes(1), dtype=np.uint8)
        offsets = {name: offset for name, _, _, offset, _ in info["buffers"]}
        for name, b in buffers.items():
            assert np.array_equal(stored[offsets[name] : offsets[name] + b.nbytes], b), name
        if checksums:
            assert len(info["checksums"]) == len(info["chunks"])
            spans = sorted((offset, offset + nbytes) for _, nbytes, _, offset, _ in info["buffers"])
            for (begin, nbytes, _), crc in zip(info["chunks"], info["checksums"]):
                expected, end = 0, begin + nbytes  # a chunk's CRC covers its buffers' bytes, not the padding
                for lo, hi in spans:
                    if max(lo, begin) < min(hi, end):
                        piece = stored[max(lo, begin) : min(hi, end)]
                        expected = _probes.crc32c(piece, crc=expected, implementation="software")
                assert crc == expected
    finally:
        store.close()


def test_checksums_off_still_round_trips():
    store = peerstate.SnapshotStore(checksums=False)
    try:
        t = byte_tensor(1 << 20, 3)
        before = t.clone()
        store.register("t", t)
        store.snapshot(1).wait()
        assert store.version_info(1)["checksums"] == []
        fill(t, 4)
        store.restore(1)
        assert torch.equal(t, before)
    finally:
        store.close()


def test_registered_objects_travel_with_versions(store):
    state = {"lr": 0.1, "epoch": 0}
    t = byte_tensor(100, 1)
    store.register("t", t)
    store.register_object("sched", lambda: dict(state), lambda v: state.update(v))
    store.snapshot(1).wait()
    state.update(lr=0.05, epoch=3)
    store.snapshot(2).wait()
    state.update(lr=0.0, epoch=9)
    store.restore(1)
    assert state == {"lr": 0.1, "epoch": 0}


def test_errors_share_one_root():
    for name in peerstate.errors.__all__:
        assert issubclass(getattr(peerstate, name), peerstate.Error)
    assert issubclass(peerstate.InvalidArgumentError, ValueError)
    assert issubclass(peerstate.TimeoutError, TimeoutError)


def test_training_state_round_trip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step():
        loss = model(torch.randn(8, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    step()  # creates Adam's moments
    store = peerstate.SnapshotStore()
    try:
        names = peerstate.register_training_state(store, model=model, optimizer=opt)
        assert any(n.endswith("exp_avg_sq") for n in names) and "optimizer/param_groups" in names
        store.snapshot(1).wait()
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
        saved_lr = opt.param_groups[0]["lr"]
        for _ in range(3):
            step()
        assert opt.param_groups[0]["lr"] != saved_lr
        store.restore(1)
        assert all(torch.equal(v, saved_model[k]) for k, v in model.state_dict().items())
        for i, p in enumerate(model.parameters()):
            for k, v in opt.state[p].items():
                assert torch.equal(v, saved_opt[(i, k)]), (i, k)
        assert opt.param_groups[0]["lr"] == saved_lr
    finally:
        store.close()


def test_same_bytes_other_dtype_or_shape_is_refused(store):
    t = torch.randn(100, 10)
    store.register("t", t)
    store.snapshot(1).wait()
    for other in (torch.zeros(10, 100), torch.zeros(100, 20, dtype=torch.float16)):
        store.register("t", other)  # the same 4000 bytes, other meaning
        with pytest.raises(peerstate.RegistrationMismatchError, match=r"held torch.float32\[100, 10\] and now holds"):
            store.restore(1)
        assert not other.any()


def test_allocate_up_front(store):
    store.register("t", byte_tensor(100_000, 1))
    assert store.memory()["held_bytes"] == 0
    store.allocate()
    held = store.memory()["held_bytes"]
    assert held >= 2 * 100_000
    store.snapshot(1).wait()
    store.snapshot(2).wait()
    assert store.memory()["held_bytes"] == held  # nothing allocated per step

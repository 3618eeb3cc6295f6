"""SnapshotStore: per-step, versioned, checksummed in-memory copies of training state.

A thin layer over ``peerstate._C.SnapshotStore``: it turns tensors and arrays
into registered buffers, keeps them alive, checks before each copy that they
still own the memory that was registered, and carries small Python state
(``register_object``) inside each version. The copying, checksums, memory
budget and version rules live in the native store; see ``_C.pyi``.

Small Python state is pickled at each snapshot into one registered byte
buffer (``OBJECTS_BUFFER``), so it is checksummed, versioned and replicated
with the tensors, with no second mechanism.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional

from peerstate import _C
from peerstate.state.buffers import HOST, Buffer, describe
from peerstate.errors import InvalidArgumentError, NotFoundError, RegistrationMismatchError

DEFAULT_CHUNK_BYTES = 4 << 20  # the unit of checksums and transfer, and of a parity piece

OBJECTS_BUFFER = "__peerstate_objects__"
_LENGTH_BYTES = 8


class SnapshotHandle:
    """The snapshot of one version, started by :meth:`SnapshotStore.snapshot`."""

    def __init__(self, store: "SnapshotStore", version: int) -> None:
        self._store = store
        self.version = version

    def done(self) -> bool:
        """True once the version committed or failed (does not block)."""
        return self._store.in_flight_version() != self.version

    def wait(self) -> None:
        """Block until the version commits; raise its error if it failed."""
        if not self.done():
            self._store.wait()


class SnapshotStore:
    """Versioned snapshots of registered buffers, restorable in place.

    Args:
        threads: copy threads (default: the cores this process may use).
        chunk_bytes: chunk size; small buffers share chunks, large ones span several.
        max_versions: version slots kept (>= 2): the newest committed version is
            never overwritten by the snapshot in flight.
        budget_bytes: bound on snapshot memory (default: half of physical memory);
            registering more than ``max_versions`` copies fit is an error.
        checksums: CRC32C per chunk, verified before every restore.
        validate: at each snapshot, check that every registered tensor still
            owns the memory it was registered with, before any of its bytes are
            copied (~1 us per tensor whose metadata is out of cache; the copy of
            the buffers already checked runs meanwhile).
        object_capacity: bytes reserved for the pickled objects of ``register_object``.
    """

    def __init__(
        self,
        *,
        threads: Optional[int] = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_versions: int = 2,
        budget_bytes: Optional[int] = None,
        checksums: bool = True,
        validate: bool = True,
        object_capacity: int = 256 * 1024,
    ) -> None:
        self.max_versions = max_versions
        self._native = _C.SnapshotStore(
            threads=threads or 0,
            chunk_bytes=chunk_bytes,
            max_versions=max_versions,
            budget_bytes=budget_bytes or 0,
            checksums=checksums,
        )
        self.validate = validate
        self.object_capacity = object_capacity
        self._buffers: Dict[str, Buffer] = {}
        self._objects: Dict[str, tuple] = {}
        self._object_bytes = None  # numpy uint8 array, registered with the first object
        self._pre_snapshot_hooks: List[Callable[[], None]] = []
        self._checks: Optional[_RegistrationChecks] = None  # built on first use after a registration change

    # -- registration ---------------------------------------------------------------
    def register(self, name: str, obj: Any) -> None:
        """Register one tensor/array/buffer (or a ``ByteRange`` of one) under ``name``
        (replacing a previous one)."""
        self.register_many({name: obj})

    def register_many(self, buffers: Mapping[str, Any]) -> None:
        """Register several at once: all or nothing, one layout computation."""
        described = {name: describe(name, obj) for name, obj in buffers.items()}
        self._native.register_buffers([_C.BufferRegistration(n, b.ptr, b.nbytes, b.device, b.dtype)
                                       for n, b in described.items()])
        self._buffers.update(described)
        self._checks = None

    def register_object(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """Register small Python state captured eagerly (pickled) at each snapshot.

        ``get()`` is called in :meth:`snapshot`; ``set(value)`` in :meth:`restore`,
        after the buffers were restored. Use it for hyperparameters, counters and
        other non-tensor state; values travel inside the version, so replicas
        carry them too.
        """
        if name in self._objects or name in self._buffers:
            raise InvalidArgumentError(f"'{name}' is already registered; unregister it first")
        if self._object_bytes is None:
            import numpy as np

            self._object_bytes = np.zeros(self.object_capacity, dtype=np.uint8)
            self.register(OBJECTS_BUFFER, self._object_bytes)
        self._objects[name] = (get, set)

    def unregister(self, *names: str) -> None:
        """Remove buffers or objects by name."""
        unknown = [n for n in names if n not in self._buffers and n not in self._objects]
        if unknown:
            raise NotFoundError(f"not registered: {', '.join(map(repr, unknown))}; nothing was unregistered")
        native = [n for n in names if n in self._buffers]
        if native:
            self._native.unregister(native)
        for n in names:
            self._buffers.pop(n, None)
            self._objects.pop(n, None)
        self._checks = None

    def registered(self) -> List[str]:
        """Names of the registered buffers and objects."""
        return [n for n in self._buffers if n != OBJECTS_BUFFER] + list(self._objects)

    def owners(self) -> Dict[str, Any]:
        """name -> the registered tensor/array itself (not the objects buffer; the whole
        of it for a ByteRange)."""
        return {n: b.owner for n, b in self._buffers.items() if n != OBJECTS_BUFFER}

    def capture_objects(self) -> Dict[str, Any]:
        """name -> ``get()`` of every registered object, now."""
        return {name: get() for name, (get, _) in self._objects.items()}

    def apply_objects(self, values: Mapping[str, Any]) -> None:
        """Call each registered object's ``set`` with its value from ``values``."""
        for name, (_, setter) in self._objects.items():
            setter(values[name])

    def add_pre_snapshot_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at the start of every :meth:`snapshot` (e.g. to wait for replication)."""
        self._pre_snapshot_hooks.append(hook)

    # -- versions -------------------------------------------------------------------
    def snapshot(self, version: int) -> SnapshotHandle:
        """Start snapshotting every registered buffer as ``version``; returns at once.

        If the previous version is still in flight this waits for it first. Device
        copies are ordered after the work already queued on torch's current CUDA
        stream, so call this after ``optimizer.step()`` has been queued.
        """
        for hook in self._pre_snapshot_hooks:
            hook()
        if self._objects:
            self._native.wait()  # the object buffer is about to change: the last copy must be done
            self._write_objects()
        checks = self._registration_checks() if self.validate else None
        if checks is None or len(checks.host) <= 1:  # nothing to check, or nothing to overlap the check with
            if checks is not None:
                checks.check_all()
            self._native.snapshot(version, self._after_stream())
            return SnapshotHandle(self, version)
        # Host buffers are checked in batches while the copy of those already
        # checked runs (gated in the native store): with tens of thousands of
        # small tensors the check alone is a quarter of the copy's time.
        # Device copies are queued by the native call, so those are checked first.
        for batch in checks.device:
            batch.check()
        self._native.snapshot(version, self._after_stream(), gated=True)
        try:
            for batch in checks.host:
                batch.check()
                self._native.validated(batch.end)
        except BaseException:
            self._native.cancel()
            raise
        return SnapshotHandle(self, version)

    def wait(self) -> None:
        """Block until the version in flight (if any) commits; raise its error."""
        self._native.wait()

    def restore(self, version: int, verify: bool = True) -> int:
        """Copy committed ``version`` back into the registered buffers and objects.

        Checksums are verified first: on any error nothing is written. Versions
        newer than ``version`` are dropped and the one in flight is cancelled.
        ``verify=False`` skips that pass, for a version this process received a
        moment ago (every chunk was verified as it arrived). Host chunks whose
        bytes already equal the live ones are left alone. Returns the bytes written.
        """
        self._registration_checks().check_all()
        if self._objects:
            stored = self._stored_objects(version)
            missing = [n for n in self._objects if stored is not None and n not in stored]
            if missing:
                raise RegistrationMismatchError(
                    f"version {version} holds no value for object(s) {missing}; it was taken before "
                    "they were registered. The live state was not changed."
                )
        written = self._native.restore(version, verify)
        if self._objects:
            self.apply_objects(self._read_objects(memoryview(self._object_bytes)))
        return written

    def drop_newer(self, version: int) -> None:
        """Forget versions newer than ``version`` (and the one in flight) without
        touching the buffers: after state was rolled back by other means, e.g. a
        disk checkpoint of step ``version``."""
        self._native.drop_newer(version)

    def committed_versions(self) -> List[int]:
        """Committed versions, oldest first."""
        return self._native.committed_versions()

    def in_flight_version(self) -> Optional[int]:
        """The version being copied now, or None."""
        return self._native.in_flight_version()

    def memory(self) -> Dict[str, Any]:
        """Bytes registered, per version, held now, and the budget."""
        return self._native.memory()

    def version_info(self, version: int) -> Dict[str, Any]:
        """Layout and chunk checksums of a committed version."""
        return self._native.version_info(version)

    def region_address(self, version: int) -> int:
        """Address of ``version``'s bytes (committed or in flight) in this process, 0 if
        none: a puller on this machine reads them from there (``Replication.pull``)."""
        return self._native.region_address(version)

    def stored_bytes(self, version: int) -> memoryview:
        """The raw bytes of a committed version (writable: for transports and fault tests)."""
        return self._native.stored_bytes(version)

    def allocate(self) -> None:
        """Allocate every version slot now (a hot spare does this before it is needed)."""
        self._native.allocate()

    def close(self) -> None:
        """Cancel the version in flight and free all snapshot memory."""
        self._native.close()

    def __enter__(self) -> "SnapshotStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def native(self) -> "_C.SnapshotStore":
        return self._native

    # -- internals ------------------------------------------------------------------
    def _registration_checks(self) -> "_RegistrationChecks":
        if self._checks is None:
            self._checks = _RegistrationChecks(self._native.buffer_names(), self._buffers)
        return self._checks

    def _after_stream(self) -> int:
        if not any(b.device >= 0 for b in self._buffers.values()):
            return 0
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return 0
        return torch.cuda.current_stream().cuda_stream

    def _write_objects(self) -> None:
        payload = pickle.dumps(self.capture_objects(), protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) + _LENGTH_BYTES > self.object_capacity:
            raise InvalidArgumentError(
                f"the registered objects pickle to {len(payload)} bytes, over object_capacity="
                f"{self.object_capacity}; create the SnapshotStore with a larger object_capacity"
            )
        self._object_bytes[:_LENGTH_BYTES] = memoryview(len(payload).to_bytes(_LENGTH_BYTES, "little"))
        self._object_bytes[_LENGTH_BYTES : _LENGTH_BYTES + len(payload)] = memoryview(payload)

    @staticmethod
    def _read_objects(raw: memoryview) -> Dict[str, Any]:
        length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
        if length == 0 or length > len(raw) - _LENGTH_BYTES:
            return {}
        return pickle.loads(raw[_LENGTH_BYTES : _LENGTH_BYTES + length])

    def _stored_objects(self, version: int) -> Optional[Dict[str, Any]]:
        """The objects inside a committed version, or None if it cannot be read
        (unknown or corrupt version: the native restore then says why)."""
        try:
            info = self._native.version_info(version)
            offset, nbytes = next((b[3], b[1]) for b in info["buffers"] if b[0] == OBJECTS_BUFFER)
            return self._read_objects(self._native.stored_bytes(version)[offset : offset + nbytes])
        except Exception:  # noqa: BLE001 - any failure here is reported by the restore itself
            return None


class _CheckBatch:
    """Consecutive registered buffers (layout order) checked together: torch
    tensors by one ``data_ptr`` comparison of the whole batch, the rest one by one."""

    def __init__(self, end: int, named: List[tuple]) -> None:
        self.end = end  # buffers in layout order up to here are checked with this batch
        self._named = named
        torch = sys.modules.get("torch")
        tensor = torch.Tensor if torch is not None else ()
        fast = [isinstance(b.owner, tensor) and b.nbytes > 0 for _, b in named]
        self._data_ptr = torch.Tensor.data_ptr if any(fast) else None
        self._tensors = [b.owner for (_, b), f in zip(named, fast) if f]
        self._pointers = [b.ptr - b.offset for (_, b), f in zip(named, fast) if f]
        self._others = [item for item, f in zip(named, fast) if not f]

    def check(self) -> None:
        """Raise RegistrationMismatchError naming the first buffer that lost its memory."""
        if self._tensors and list(map(self._data_ptr, self._tensors)) != self._pointers:
            self._raise_first_moved(self._named)
        self._raise_first_moved(self._others)

    @staticmethod
    def _raise_first_moved(named: List[tuple]) -> None:
        for name, buffer in named:
            why = buffer.moved()
            if why:
                raise RegistrationMismatchError(
                    f"buffer '{name}' no longer matches its registration: {why}; register it "
                    "again. The live buffers and the committed versions were not changed."
                )


class _RegistrationChecks:
    """The registration check of every buffer, in the native store's layout order."""

    BATCH = 256  # buffers per batch: the copy starts after the first one is checked

    def __init__(self, layout_order: List[str], buffers: Mapping[str, Buffer]) -> None:
        host = [(n, buffers[n]) for n in layout_order if buffers[n].device == HOST]
        device = [(n, buffers[n]) for n in layout_order if buffers[n].device != HOST]
        self.host = [_CheckBatch(min(i + self.BATCH, len(host)), host[i : i + self.BATCH])
                     for i in range(0, len(host), self.BATCH)]
        self.device = [_CheckBatch(len(host), device)] if device else []

    def check_all(self) -> None:
        for batch in self.device + self.host:
            batch.check()

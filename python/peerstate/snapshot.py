"""SnapshotStore: per-step, versioned, checksummed in-memory copies of training state.

A thin layer over ``peerstate._C.SnapshotStore``: it turns tensors and arrays
into registered buffers, keeps them alive, checks before each copy that they
still own the memory that was registered, and carries small Python state
(``register_object``) alongside each version. The copying, checksums, memory
budget and version rules live in the native store; see ``_C.pyi``.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

from peerstate import _C
from peerstate.buffers import Buffer, describe
from peerstate.errors import InvalidArgumentError, NotFoundError, RegistrationMismatchError


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
        validate: before each snapshot, check that every registered tensor still
            owns the memory it was registered with (costs ~0.3 us per buffer).
    """

    def __init__(
        self,
        *,
        threads: Optional[int] = None,
        chunk_bytes: int = 4 << 20,
        max_versions: int = 2,
        budget_bytes: Optional[int] = None,
        checksums: bool = True,
        validate: bool = True,
    ) -> None:
        self._native = _C.SnapshotStore(
            threads=threads or 0,
            chunk_bytes=chunk_bytes,
            max_versions=max_versions,
            budget_bytes=budget_bytes or 0,
            checksums=checksums,
        )
        self.validate = validate
        self._buffers: Dict[str, Buffer] = {}
        self._objects: Dict[str, tuple] = {}
        self._object_values: Dict[int, Dict[str, bytes]] = {}

    # -- registration ---------------------------------------------------------------
    def register(self, name: str, obj: Any) -> None:
        """Register one tensor/array/buffer under ``name`` (replacing a previous one)."""
        self.register_many({name: obj})

    def register_many(self, buffers: Mapping[str, Any]) -> None:
        """Register several at once: all or nothing, one layout computation."""
        described = {name: describe(name, obj) for name, obj in buffers.items()}
        self._native.register_buffers([(n, b.ptr, b.nbytes, b.device) for n, b in described.items()])
        self._buffers.update(described)

    def register_object(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """Register small Python state captured eagerly (pickled) at each snapshot.

        ``get()`` is called in :meth:`snapshot`; ``set(value)`` in :meth:`restore`,
        after the buffers were restored. Use it for hyperparameters, counters and
        other non-tensor state.
        """
        if name in self._objects or name in self._buffers:
            raise InvalidArgumentError(f"'{name}' is already registered; unregister it first")
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

    def registered(self) -> List[str]:
        """Names of the registered buffers and objects."""
        return list(self._buffers) + list(self._objects)

    # -- versions -------------------------------------------------------------------
    def snapshot(self, version: int) -> SnapshotHandle:
        """Start snapshotting every registered buffer as ``version``; returns at once.

        If the previous version is still in flight this waits for it first. Device
        copies are ordered after the work already queued on torch's current CUDA
        stream, so call this after ``optimizer.step()`` has been queued.
        """
        if self.validate:
            self._check_registration()
        values = {name: pickle.dumps(get(), protocol=pickle.HIGHEST_PROTOCOL) for name, (get, _) in self._objects.items()}
        self._native.snapshot(version, self._after_stream())
        self._object_values[version] = values
        self._prune_objects()
        return SnapshotHandle(self, version)

    def wait(self) -> None:
        """Block until the version in flight (if any) commits; raise its error."""
        try:
            self._native.wait()
        finally:
            self._prune_objects()

    def restore(self, version: int) -> None:
        """Copy committed ``version`` back into the registered buffers and objects.

        Checksums are verified first: on any error nothing is written. Versions
        newer than ``version`` are dropped and the one in flight is cancelled.
        """
        self._check_registration()
        values = self._object_values.get(version)
        if self._objects and values is None and version in self.committed_versions():
            raise RegistrationMismatchError(
                f"version {version} holds no values for the registered objects; it was taken "
                "before they were registered"
            )
        missing = [n for n in self._objects if values is not None and n not in values]
        if missing:
            raise RegistrationMismatchError(
                f"version {version} holds no value for object(s) {missing}; it was taken before "
                "they were registered. The live state was not changed."
            )
        self._native.restore(version)
        for name, (_, setter) in self._objects.items():
            setter(pickle.loads(values[name]))
        self._prune_objects()

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

    def stored_bytes(self, version: int) -> memoryview:
        """The raw bytes of a committed version (writable: for transports and fault tests)."""
        return self._native.stored_bytes(version)

    def close(self) -> None:
        """Cancel the version in flight and free all snapshot memory."""
        self._native.close()
        self._object_values.clear()

    def __enter__(self) -> "SnapshotStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def native(self) -> "_C.SnapshotStore":
        return self._native

    # -- internals ------------------------------------------------------------------
    def _check_registration(self) -> None:
        for name, buffer in self._buffers.items():
            why = buffer.moved()
            if why:
                raise RegistrationMismatchError(
                    f"buffer '{name}' no longer matches its registration: {why}; register it "
                    "again. Nothing was copied."
                )

    def _after_stream(self) -> int:
        if not any(b.device >= 0 for b in self._buffers.values()):
            return 0
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return 0
        return torch.cuda.current_stream().cuda_stream

    def _prune_objects(self) -> None:
        keep = set(self._native.committed_versions())
        in_flight = self._native.in_flight_version()
        if in_flight is not None:
            keep.add(in_flight)
        for v in [v for v in self._object_values if v not in keep]:
            del self._object_values[v]

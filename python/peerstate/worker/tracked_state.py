"""The training state a job tracks, in the stores that snapshot it: this rank's
own store (RNG, loader, extras, and everything when the state differs per rank)
and, with ``track(data_parallel=True)``, one store per data-parallel share."""

from __future__ import annotations

import functools
import pickle
import sys
from typing import Any, Callable, Container, Dict, List, Mapping, Optional, Sequence, Tuple

from peerstate.control.messages import StateLayout
from peerstate.errors import InvalidArgumentError
from peerstate.replication.placement import DataParallelShares, default_share_count, mesh_replica_sets
from peerstate.state.buffers import ByteRange
from peerstate.state.snapshot import SnapshotStore
from peerstate.state.training_state import (capture_rng, check_optimizer_state, model_parts, optimizer_parts,
                                            restore_rng, rng_fingerprint, training_state)
from peerstate.worker.host_budget import HostMemoryBudget

# Slots of a share this rank does not snapshot itself: where a recovery lands it.
PULLED_SHARE_VERSIONS = 2


class TrackedState:
    """What ``Job.track`` was given, and the stores it is registered in.

    ``own`` exists from the start; the share stores only once ``register`` runs for
    data-parallel state. Every store snapshots on the process's one copy-thread
    pool (``ThreadPool::shared`` in the native core).

    ``node_of_rank``, ``k``, ``parity_group``: the job's layout; ``share_count``: the
    data-parallel shares asked for (None: ``default_share_count``), cut once ``track``
    says which ranks hold equal copies."""

    def __init__(self, node_of_rank: Sequence[int], k: int, share_count: Optional[int], versions: int,
                 threads: Optional[int], budget: Optional[HostMemoryBudget] = None, parity_group: int = 0) -> None:
        self.node_of_rank = list(node_of_rank)
        self.k = k
        self.parity_group = parity_group
        self.share_count = share_count
        self.shares = DataParallelShares(self.node_of_rank, 1)  # until track() says which ranks are replicas
        self.layout = StateLayout(k, parity_group=parity_group)
        self.versions = versions
        self.threads = threads
        self.budget = budget  # checked before the versions are allocated (and the replicas: reserve_replicas)
        self.own = SnapshotStore(max_versions=versions, threads=threads)
        self.share_stores: List[SnapshotStore] = []
        self.objects: Dict[str, Any] = {}
        # name -> an object with state_dict()/load_state_dict() (restored in place) or a plain
        # picklable value (captured from here at each snapshot, written back here on restore)
        self.extras: Dict[str, Any] = {}
        self._restored_rng: Optional[Dict[str, Any]] = None  # the RNG states a replacement's restore set
        self.data_parallel = False
        self.registered = False

    def track(self, *, model: Any, optimizer: Any, scheduler: Any, loader: Any, extras: Mapping[str, Any],
              data_parallel: bool, replica_mesh: Sequence[int] = (), replica_dim: int = -1) -> None:
        """``replica_mesh``, ``replica_dim``: with ``data_parallel``, the ranks with equal
        copies are the groups along that dimension of a mesh of that shape (HSDP);
        every rank by default (DDP)."""
        replica_mesh = tuple(int(size) for size in replica_mesh)
        sets = mesh_replica_sets(len(self.node_of_rank), replica_mesh, replica_dim) if replica_mesh else None
        count = self.share_count if self.share_count is not None else default_share_count(self.node_of_rank, sets)
        self.shares = DataParallelShares(self.node_of_rank, count, sets)
        self.layout = StateLayout(self.k, count, data_parallel, replica_mesh, replica_dim if replica_mesh else -1,
                                  self.parity_group)
        self.objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
        for name, value in extras.items():
            if _loads_in_place(value):
                continue
            try:
                pickle.dumps(value)
            except Exception as error:  # noqa: BLE001 - whatever pickling raised, the value cannot be snapshotted
                raise InvalidArgumentError(
                    f"track(extras={{'{name}': ...}}): a {type(value).__name__} has no state_dict()/"
                    f"load_state_dict() and cannot be pickled ({error}); track a picklable value or an object "
                    "with both methods") from None
        self.extras.clear()
        self.extras.update(extras)
        self.data_parallel = data_parallel

    @property
    def tracking(self) -> bool:
        return bool(self.objects)

    def register(self, rank: Optional[int]) -> None:
        """Register the tracked state with the stores and allocate their versions
        (``rank`` None: a spare, which does not know its share yet)."""
        tracked = self.objects
        check_optimizer_state(tracked.get("optimizer"))
        tensors, objects = training_state(tracked.get("model"), tracked.get("optimizer"))
        if tracked.get("scheduler") is not None:
            objects["scheduler"] = (tracked["scheduler"].state_dict, tracked["scheduler"].load_state_dict)
        if self.data_parallel:
            self._create_share_stores(rank)
            self._register_shares(tensors, objects)
        else:
            self.own.register_many(tensors)
            for name, (get, set_) in objects.items():
                self.own.register_object(name, get, set_)
        if tracked.get("loader") is not None:
            self.own.register_object("loader", tracked["loader"].state_dict, tracked["loader"].load_state_dict)
        for name, value in self.extras.items():
            if _loads_in_place(value):
                self.own.register_object(f"extras/{name}", value.state_dict, value.load_state_dict)
            else:
                self.own.register_object(f"extras/{name}", functools.partial(self.extras.__getitem__, name),
                                         functools.partial(self.extras.__setitem__, name))
        self.own.register_object("rng", capture_rng, restore_rng)
        if self.budget is not None and rank is not None:  # a hot spare's slots are not a rank's (see host_budget)
            self.budget.own(rank, sum(store.memory()["bytes_per_version"] * store.max_versions
                                      for store in self.all_stores()), self.versions)
        for store in self.all_stores():
            store.allocate()
        self.registered = True
        print(f"peerstate: rank {rank} tracks {self.describe(tensors)}", file=sys.stderr, flush=True)

    def describe(self, tensors: Mapping[str, Any]) -> str:
        """Which path each tracked object takes, said once in the worker's log: tensors
        registered in place (snapshotted and restored where they live), or an object's
        state_dict()/load_state_dict() (captured at each boundary, loaded back)."""
        parts = []
        for name, owner in (("model", model_parts(self.objects.get("model"))),
                            ("optimizer", optimizer_parts(self.objects.get("optimizer")))):
            if owner:
                count = sum(1 for t in tensors if t.startswith(f"{name}/"))
                parts.append(f"{name} ({len(owner)} part{'s' if len(owner) > 1 else ''}, {count} tensors in place)")
        loaded = [n for n in ("scheduler", "loader") if self.objects.get(n) is not None]
        loaded += [f"extras[{n!r}]" for n, v in self.extras.items() if _loads_in_place(v)]
        if loaded:
            parts.append(f"{', '.join(loaded)} through state_dict()/load_state_dict()")
        plain = [n for n, v in self.extras.items() if not _loads_in_place(v)]
        if plain:
            parts.append(f"extras {plain} by value")
        return "; ".join(parts) + "; the RNG states"

    def _create_share_stores(self, rank: Optional[int]) -> None:
        """One store per data-parallel share. This rank snapshots its own share into
        ``versions`` slots; the others only receive the shares it pulls at a recovery.
        A spare registers before it knows its share: all get ``versions``."""
        if self.share_stores:
            return
        own = None if rank is None else self.shares.local(self.shares.share_of(rank))
        self.share_stores = [SnapshotStore(max_versions=self.versions if own in (None, share) else
                                           PULLED_SHARE_VERSIONS, threads=self.threads)
                             for share in range(self.shares.count)]

    def _register_shares(self, tensors: Mapping[str, Any], objects: Mapping[str, Tuple[Callable, Callable]]) -> None:
        """Cut the data-parallel state into the share stores (the same cut on every
        member of a replica set; a tensor across a cut is registered as two byte
        ranges); its Python state goes with the lightest share."""
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        load = [0] * self.shares.count
        for (name, tensor), size, pieces in zip(tensors.items(), sizes, self.shares.split(sizes)):
            for share, start, end in pieces:
                if (start, end) == (0, size):
                    self.share_stores[share].register(name, tensor)
                else:
                    self.share_stores[share].register(f"{name}[{start}:{end}]", ByteRange(tensor, start, end - start))
                load[share] += end - start
        lightest = self.share_stores[load.index(min(load))]
        for name, (get, set_) in objects.items():
            lightest.register_object(name, get, set_)
        empty = [share for share, store in enumerate(self.share_stores) if not store.registered()]
        if empty:
            raise InvalidArgumentError(f"data-parallel shares {empty} would be empty: the tracked state has "
                                       f"{sum(sizes)} bytes for {self.shares.count} shares; pass "
                                       "Job(data_parallel_shares=...) a smaller count")

    def own_share(self, rank: int) -> Optional[SnapshotStore]:
        """The share store ``rank`` snapshots (None without data-parallel state)."""
        if not (self.data_parallel and self.share_stores):
            return None  # not data-parallel, or not registered yet (a worker registers at its first step)
        return self.share_stores[self.shares.local(self.shares.share_of(rank))]

    def snapshotted(self, rank: int) -> List[SnapshotStore]:
        """The stores ``rank`` snapshots: its own, then its share of the data-parallel state."""
        share = self.own_share(rank)
        return [self.own] if share is None else [self.own, share]

    def memory(self, rank: Optional[int]) -> Dict[str, int]:
        """Bytes ``rank`` copies a step (its own store and its share; a spare without a
        rank: its own), and bytes held by the version slots of every store."""
        stores = self.snapshotted(rank) if rank is not None else [self.own]
        return {"snapshot_per_version": sum(store.memory()["bytes_per_version"] for store in stores),
                "snapshots_held": sum(store.memory()["held_bytes"] for store in self.all_stores())}

    def all_stores(self) -> List[SnapshotStore]:
        """Every store holding tracked state: this rank's own, then each data-parallel share."""
        return [self.own, *self.share_stores] if self.data_parallel else [self.own]

    def local_versions(self, rank: int) -> List[int]:
        """The versions every store ``rank`` snapshots holds. The version in flight
        counts as held: a local copy does not fail short of a bug, and waiting for it
        would put it on every recovery's critical path (it is waited for by
        ``restore`` only if it is the recovery point)."""
        held = set.intersection(*({*store.committed_versions(), store.in_flight_version()} - {None}
                                  for store in self.snapshotted(rank)))
        return sorted(held)

    def restore(self, version: int, pulled_shares: Container[int] = (), pulled_own: bool = False) -> None:
        """Restore ``version`` from every store, the data-parallel shares first: their
        objects (scheduler) are applied before this rank's own (RNG). A newer version
        in flight is cancelled; ``version`` itself, if in flight, is waited for.
        What was just pulled (``pulled_shares``, and this rank's own state with
        ``pulled_own``) skips the checksum pass: every chunk was verified as it arrived."""
        shares = [(store, share in pulled_shares) for share, store in enumerate(self.share_stores)]
        for store, pulled in (shares if self.data_parallel else []) + [(self.own, pulled_own)]:
            if store.in_flight_version() == version:
                store.wait()
            store.restore(version, verify=not pulled)
        self.clear_gradients()

    def remember_rng(self) -> None:
        """Note the RNG states a restore just set (see ``rng_changed``)."""
        self._restored_rng = rng_fingerprint()

    def rng_changed(self) -> List[str]:
        """The generators (python, numpy, torch, cuda) that moved since ``remember_rng``
        (then forgets them): a replacement's script that seeds or draws after
        ``track()`` has thrown away the state it was restored to. A generator that
        appeared since (CUDA initialised after ``track()``) is not a change."""
        restored, self._restored_rng = self._restored_rng, None
        if restored is None:
            return []
        now = rng_fingerprint()
        return sorted(name for name, state in restored.items() if name in now and now[name] != state)

    def clear_gradients(self) -> None:
        """Set the gradient of every tracked parameter to None. The step after a restore
        must not start from the aborted step's partial gradients: a loop that zeroes
        them after ``optimizer.step()`` would add its replay onto them."""
        for owner in (*model_parts(self.objects.get("model")), *optimizer_parts(self.objects.get("optimizer"))):
            owner.zero_grad(set_to_none=True)

    def checkpoint_state(self, rank: int) -> Dict[str, Any]:
        """What a disk checkpoint holds, keyed the same whatever the data-parallel
        shares: this rank's own tensors and objects, then the whole data-parallel
        tensors and the objects of every share."""
        import torch

        own = {name: owner for name, owner in self.own.owners().items() if isinstance(owner, torch.Tensor)}
        state: Dict[str, Any] = {f"rank{rank}/own/{name}": t for name, t in own.items()}
        state[f"rank{rank}/own/objects"] = self.own.capture_objects()
        if self.data_parallel:
            tensors, _ = training_state(self.objects.get("model"), self.objects.get("optimizer"))
            state.update({f"rank{rank}/data_parallel/{name}": t for name, t in tensors.items()})
            state[f"rank{rank}/data_parallel/objects"] = {
                name: value for store in self.share_stores for name, value in store.capture_objects().items()}
        return state

    def apply_checkpoint(self, state: Mapping[str, Any], rank: int, step: int) -> None:
        """After ``dcp.load`` filled the tensors of ``checkpoint_state``: apply its objects,
        and drop the versions newer than ``step`` (the next snapshot is step + 1)."""
        for store in self.all_stores():
            part = "own" if store is self.own else "data_parallel"
            store.apply_objects(state[f"rank{rank}/{part}/objects"])
            store.drop_newer(step)
        self.clear_gradients()

    def close(self) -> None:
        for store in (self.own, *self.share_stores):
            store.close()


def _loads_in_place(value: Any) -> bool:
    """An extra restored through its own state_dict()/load_state_dict()."""
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")

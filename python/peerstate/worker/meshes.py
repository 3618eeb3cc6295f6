"""Device meshes whose process groups peerstate aborts and re-forms in every epoch.

A ``torch.distributed.device_mesh.DeviceMesh`` does not hold its groups: it
holds their names and looks a group up by name at each use
(``mesh.get_group(dim)``); so do the DTensors, tensor-parallel plans and
FSDP2 modules built on it. torch names a group after a per-process counter
that ``ProcessGroups.form`` resets with every epoch, so a mesh created again
in the same place of the same sequence of groups gets the same names. That
is how a re-formed epoch keeps the script's mesh (and everything built on
it) valid: peerstate creates a fresh mesh with the same shape right after the
default group and the declared subgroups, checks that its group names are
the old ones, and drops it; the script goes on using the mesh it was given.

Production trainers build their meshes from one world mesh (torchtitan's
``ParallelDims.build_mesh``: ``init_device_mesh``, then ``_unflatten``,
``_flatten``, slicing, ``backend_override``). Such a script hands peerstate its
builder (``Job.build_meshes``): peerstate runs it in every epoch right after its
own groups, checks that it created the same groups under the same names, counts
them as its own (aborted with the others) and drops the new objects; the
script keeps what the first call returned (``BuiltMeshes``).

What a script must do: declare every mesh with ``Job.device_mesh`` or
``Job.build_meshes`` before ``track()``, every process in the same order (a hot
spare too: its meshes are formed when it is given a rank). A mesh created with
``init_device_mesh`` directly, or a group from ``torch.distributed.new_group``,
is neither aborted nor re-formed, and ``Job.guard`` refuses to run a step while
one exists.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from peerstate.errors import InvalidArgumentError
from peerstate.worker import torch_private


class DeclaredMesh:
    """A device mesh declared with ``Job.device_mesh``. ``mesh`` is torch's
    ``DeviceMesh``, the same object in every epoch: pass it (or its slices,
    ``declared.mesh["tp"]``) to ``fully_shard``, ``parallelize_module`` and
    pipelining."""

    def __init__(self, device_type: str, shape: Sequence[int], dim_names: Optional[Sequence[str]]) -> None:
        self.device_type = device_type
        self.shape = tuple(int(size) for size in shape)
        self.dim_names = tuple(dim_names) if dim_names is not None else None
        self._mesh: Any = None
        self._formed = False

    @classmethod
    def declared(cls, device_type: str, mesh_shape: Sequence[int], dim_names: Optional[Sequence[str]],
                 world_size: int) -> "DeclaredMesh":
        """``Job.device_mesh``'s arguments, checked against the world size."""
        shape = [int(size) for size in mesh_shape]
        if not shape or any(size < 1 for size in shape) or math.prod(shape) != world_size:
            raise InvalidArgumentError(f"device_mesh() needs a shape whose sizes multiply to the world size "
                                       f"{world_size}, got {list(mesh_shape)}")
        if dim_names is not None and len(dim_names) != len(shape):
            raise InvalidArgumentError(f"device_mesh() got {len(dim_names)} dimension names "
                                       f"{list(dim_names)} for the {len(shape)} dimensions of {shape}")
        return cls(device_type, shape, dim_names)

    @property
    def mesh(self) -> Any:
        """The ``DeviceMesh`` (raises while this process has no rank: a spare
        waiting in ``track()``, or between two epochs)."""
        if not self._formed:
            raise InvalidArgumentError(
                f"the device mesh {self.shape} is not formed: this process has no rank yet (a spare before "
                "wait_for_rank() or track() returned) or its epoch's groups are being re-formed")
        return self._mesh

    def get_group(self, dim: Any = None) -> Any:
        """This epoch's process group of mesh dimension ``dim`` (an index or a name).
        Read it at each use: a recovery replaces it."""
        return self.mesh.get_group(dim)

    def dissolve(self) -> None:
        """Its groups are gone (the epoch's groups were destroyed)."""
        self._formed = False

    def form(self, create_timeout: Optional[float], set_wait: Callable[[Any], None]) -> None:
        """Create the mesh's groups for this epoch (every member of the epoch calls it at
        the same point of its sequence of groups). ``create_timeout``: the timeout its
        groups are created under (None: torch's default); ``set_wait`` then gives each
        group its collective timeout. Raises RuntimeError when the groups came out
        under other names than in the first epoch (see the module docstring)."""
        from torch.distributed.device_mesh import init_device_mesh

        with _created_under(create_timeout):
            fresh = init_device_mesh(self.device_type, self.shape, mesh_dim_names=self.dim_names)
        for dim in range(len(self.shape)):
            set_wait(fresh.get_group(dim))
        if self._mesh is None:
            self._mesh = fresh
        elif torch_private.mesh_group_names(fresh) != torch_private.mesh_group_names(self._mesh):
            raise RuntimeError(
                f"the re-formed device mesh {self.shape} got process groups named "
                f"{torch_private.mesh_group_names(fresh)}, not {torch_private.mesh_group_names(self._mesh)}: a "
                "process group was created in this epoch before the mesh that was not there in the first (create "
                "every group with job.new_group or job.device_mesh, before track())")
        else:
            torch_private.share_mesh_groups(self._mesh, fresh)
        self._formed = True


class BuiltMeshes:
    """Meshes a script builds itself, declared with ``Job.build_meshes(builder)``.
    ``value`` is what the builder returned the first time, the same object in every
    epoch (its meshes find their groups by name, as ``DeclaredMesh`` says).
    ``layout``: the world mesh's dimensions and sizes, in order, where the builder
    unflattens one (what ``track(data_parallel=NAME)`` reads; a spare must know it
    before it has a rank, and so before the builder can run)."""

    def __init__(self, builder: Callable[[], Any], layout: Optional[Sequence[Tuple[str, int]]] = None) -> None:
        self.builder = builder
        self.shape = tuple(int(size) for _, size in layout) if layout else ()
        self.dim_names = tuple(name for name, _ in layout) if layout else None
        self._value: Any = None
        self._names: Optional[List[str]] = None  # the groups the first call created, in order
        self._formed = False

    @classmethod
    def declared(cls, builder: Callable[[], Any], layout: Optional[Sequence[Tuple[str, int]]],
                 world_size: int) -> "BuiltMeshes":
        """``Job.build_meshes``'s arguments, checked against the world size."""
        if layout is not None and math.prod(size for _, size in layout) != world_size:
            raise InvalidArgumentError(f"build_meshes(layout={list(layout)}): the sizes must multiply to the world "
                                       f"size {world_size}")
        return cls(builder, layout)

    @property
    def value(self) -> Any:
        """What the builder returned (raises while this process has no rank)."""
        if not self._formed:
            raise InvalidArgumentError(
                "the meshes of job.build_meshes() are not formed: this process has no rank yet (a spare before "
                "wait_for_rank() or track() returned) or its epoch's groups are being re-formed")
        return self._value

    def dissolve(self) -> None:
        self._formed = False

    def form(self, create_timeout: Optional[float], set_wait: Callable[[Any], None]) -> None:
        """Run the builder for this epoch (as ``DeclaredMesh.form``); raises RuntimeError
        when it created other groups, or the same under other names, than the first time."""
        import torch.distributed as dist

        existing = set(torch_private.group_names())
        with _created_under(create_timeout):
            fresh = self.builder()
        created = [(group, name) for group, name in torch_private.group_names().items() if group not in existing]
        for group, _ in created:
            if dist.get_backend(group) == "gloo":  # a fake backend's group has no wait to bound
                set_wait(group)
        names = [name for _, name in created]
        if self._names is None:
            self._value, self._names = fresh, names
        elif names != self._names:
            raise RuntimeError(
                f"job.build_meshes()'s builder created process groups named {names} in this epoch, not "
                f"{self._names}: it must create the same groups in the same order every time, and no group may be "
                "created before it that was not there in the first epoch (create every group with job.new_group, "
                "job.device_mesh or job.build_meshes, before track())")
        self._formed = True


def _created_under(seconds: Optional[float]) -> Any:
    """Groups created inside get ``seconds`` as their timeout (None: torch's default)."""
    return torch_private.groups_created_under(seconds) if seconds is not None else contextlib.nullcontext()


def replica_dimension(meshes: Sequence[Union[DeclaredMesh, BuiltMeshes]],
                      data_parallel: Union[bool, str]) -> Tuple[Tuple[int, ...], int]:
    """(mesh shape, dimension) along which the data-parallel state is the same, for
    ``Job.track(data_parallel=NAME)``: the one declared mesh with a dimension of that
    name (a ``DeclaredMesh``, or a ``BuiltMeshes`` given its ``layout``). ((), -1) for
    ``data_parallel`` True (every rank) or False."""
    if not isinstance(data_parallel, str):
        return (), -1
    named = [mesh for mesh in meshes if data_parallel in (mesh.dim_names or ())]
    if len(named) != 1:
        raise InvalidArgumentError(
            f"track(data_parallel={data_parallel!r}) names a dimension of a mesh declared with job.device_mesh() "
            "(or of the layout given to job.build_meshes()), and exactly one must have it; the declared meshes' "
            f"dimensions are {[m.dim_names for m in meshes]}")
    return named[0].shape, named[0].dim_names.index(data_parallel)

"""What the training's own distributed wrappers need after a recovery: a DDP
rebuilt on the re-formed group with the bucket layout it had settled on, and
FSDP2 modules reset onto the re-formed group."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore


class RebuildableDDP:
    """A ``DistributedDataParallel`` (a subclass: ``isinstance`` holds, attribute
    reads and writes are the DDP's own) that the job rebuilds in place on each
    re-formed process group, so the script's reference stays valid. Made by
    ``new_rebuildable_ddp``: this class is mixed into DDP's there, so that
    ``import peerstate`` needs no torch.

    A rebuild runs DDP's constructor again on the same object. What the script
    changed survives it: ``require_backward_grad_sync`` and
    ``require_forward_param_sync`` (``no_sync()``, or set directly), ``train()`` /
    ``eval()``, the comm hooks it registered, and attributes of its own.

    Why the bucket layout is carried over: a fresh DDP reduces its first
    iteration in buckets laid out in parameter order and only then re-buckets
    by the order gradients became ready. Where a gradient element sits in a
    bucket decides the order gloo/NCCL sum it across ranks, so that first
    iteration would differ from a never-rebuilt DDP in the last bit (with 3 or
    more ranks). A rebuilt DDP is therefore built with the layout the old one
    had settled on, and a replacement receives it from the survivors.
    """

    CARRIED = ("require_backward_grad_sync", "require_forward_param_sync", "training")

    def __init__(self, module: Any, init_sync: bool, options: Dict[str, Any],
                 layout: Optional[List[List[int]]] = None) -> None:
        object.__setattr__(self, "_peerstate", {"module": module, "options": options, "layout": None,
                                                "released": False, "own_hooks": 0})
        self.rebuild(init_sync, layout)

    def rebuild(self, init_sync: bool = False, layout: Optional[List[List[int]]] = None) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        built = self._peerstate
        if "reducer" in self.__dict__:
            self.release()  # the old reducer's hooks must not stay beside the new one's
        kept = {name: self.__dict__[name] for name in self.CARRIED if name in self.__dict__}
        hooks = list(self.__dict__.get("_comm_hooks", []))[built["own_hooks"]:]  # the script's
        compute = dist._compute_bucket_assignment_by_size
        if layout:
            def settled(params: Any, limits: List[int], *args: Any, **kwargs: Any) -> Tuple[list, list]:
                # DDP reverses what this returns, so hand it the layout reversed.
                per_bucket = [limits[min(i, len(limits) - 1)] for i in range(len(layout))]
                return list(reversed(layout)), list(reversed(per_bucket))

            dist._compute_bucket_assignment_by_size = settled
        try:
            DistributedDataParallel.__init__(self, built["module"], init_sync=init_sync, **built["options"])
        finally:
            dist._compute_bucket_assignment_by_size = compute
        built.update(layout=layout, released=False, own_hooks=len(self._comm_hooks))
        self.__dict__.update(kept)
        for hook, state in hooks:
            self.register_comm_hook(state, hook)

    def bucket_layout(self) -> Optional[List[List[int]]]:
        """The parameter indices of each bucket, as the DDP reduces them now."""
        built = self._peerstate
        if built["released"]:
            return built["layout"]
        data = self._get_ddp_logging_data()
        if not data.get("has_rebuilt_buckets"):
            return built["layout"]
        return [[int(i) for i in bucket.split()] for bucket in data["rebuilt_per_bucket_param_indices"].split(",")]

    def release(self) -> None:
        """Detach from an aborted group until the next rebuild. Its reducer's gradient
        hooks are removed now: they must not fire into the aborted group."""
        built = self._peerstate
        if not built["released"]:
            built["layout"] = self.bucket_layout()
            self.reducer._remove_autograd_hooks()
            built["released"] = True


_CONCRETE: List[type] = []


def new_rebuildable_ddp(module: Any, init_sync: bool, options: Dict[str, Any],
                        layout: Optional[List[List[int]]] = None) -> RebuildableDDP:
    if not _CONCRETE:
        from torch.nn.parallel import DistributedDataParallel

        _CONCRETE.append(type("RebuildableDDP", (RebuildableDDP, DistributedDataParallel), {"__module__": __name__}))
    return _CONCRETE[0](module, init_sync, options, layout)


class DistributedWrappers:
    """The job's DDP wrappers (in creation order) and its tracked model, carried
    across epochs: released at an abort, rebuilt once the group is re-formed."""

    def __init__(self, kv: KeyValueStore) -> None:
        self._kv = kv
        self.ddps: List[RebuildableDDP] = []
        self.model: Any = None
        self.saved_layouts: List[Optional[List[List[int]]]] = []  # from the disk checkpoint a job resumed from

    def wrap(self, model: Any, options: Dict[str, Any], epoch: int, replacement: bool,
             timeout: float) -> RebuildableDDP:
        """A new DDP of ``model``. A replacement skips DDP's initial broadcast (its
        state arrives from the buddies) and takes the layout the survivors published;
        where the state came from a disk checkpoint (a job that resumed from one, or a
        replacement that fell back to one, perhaps with no survivor left to publish),
        the layout comes from there."""
        index = len(self.ddps)
        layout = self.saved_layouts[index] if index < len(self.saved_layouts) else None
        if replacement and layout is None:
            key = keys.ddp_layout(epoch, len(self.ddps))
            self._kv.wait([key], timeout=timeout)
            layout = json.loads(self._kv.get(key))
        wrapper = new_rebuildable_ddp(model, init_sync=epoch == 0, options=options, layout=layout)
        self.ddps.append(wrapper)
        return wrapper

    def release(self, epoch: int, publish: bool) -> None:
        """Drop every DDP of the aborted group; with ``publish`` (a member that kept
        its state), publish their layouts for epoch ``epoch``'s replacements."""
        for wrapper in self.ddps:
            wrapper.release()
        if publish:
            for index, wrapper in enumerate(self.ddps):
                self._kv.compare_set(keys.ddp_layout(epoch, index), b"", json.dumps(wrapper.bucket_layout()).encode())

    def rebuild(self) -> None:
        for wrapper in self.ddps:
            wrapper.rebuild(init_sync=False, layout=wrapper.bucket_layout())
        reset_fsdp(self.model)

    def close(self) -> None:
        for wrapper in self.ddps:
            wrapper.release()


def reset_fsdp(model: Any) -> None:
    """After an abort, FSDP2 (``fully_shard``) modules: drop the aborted iteration
    (``reset_iter_state``: in-flight collectives, unsharded parameters, per-iteration
    trackers) and point their cached process groups (shard and, with HSDP, replicate)
    at the re-formed groups. Their device mesh finds groups by name, and a re-formed
    group has the old one's (see ``meshes``)."""
    if model is None or not hasattr(model, "reset_iter_state"):
        return
    infos = {}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
        if group is None:
            continue
        for owner in (group, *group.fsdp_params):
            for info in (owner.mesh_info, owner.post_forward_mesh_info):
                if info is not None:
                    infos[id(info)] = info
    for info in infos.values():
        if getattr(info, "shard_mesh_dim", None) is not None:
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
        if getattr(info, "replicate_mesh_dim", None) is not None:
            info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
    try:
        model.reset_iter_state()
    except Exception:  # noqa: BLE001 - it waits on the aborted iteration's collectives, which
        model.reset_iter_state()  # failed; the first call cleared them, the second finishes the reset

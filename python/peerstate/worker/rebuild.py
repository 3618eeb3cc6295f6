"""What the training's own distributed wrappers need after a recovery: a DDP
rebuilt on the re-formed group with the bucket layout it had settled on, and
FSDP2 modules reset onto the re-formed group."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore


class RebuildableDDP:
    """A DistributedDataParallel that the job rebuilds on each re-formed process
    group. Call it and use its attributes as the DDP module itself.

    Why the bucket layout is carried over: a fresh DDP reduces its first
    iteration in buckets laid out in parameter order and only then re-buckets
    by the order gradients became ready. Where a gradient element sits in a
    bucket decides the order gloo/NCCL sum it across ranks, so that first
    iteration would differ from a never-rebuilt DDP in the last bit (with 3 or
    more ranks). A rebuilt DDP is therefore built with the layout the old one
    had settled on, and a replacement receives it from the survivors.
    """

    def __init__(self, module: Any, init_sync: bool, options: Dict[str, Any],
                 layout: Optional[List[List[int]]] = None) -> None:
        self.__dict__.update(_module=module, _options=options, _ddp=None, _layout=None)
        self.rebuild(init_sync, layout)

    def rebuild(self, init_sync: bool = False, layout: Optional[List[List[int]]] = None) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.release()
        compute = dist._compute_bucket_assignment_by_size
        if layout:
            def settled(params: Any, limits: List[int], *args: Any, **kwargs: Any) -> Tuple[list, list]:
                # DDP reverses what this returns, so hand it the layout reversed.
                per_bucket = [limits[min(i, len(limits) - 1)] for i in range(len(layout))]
                return list(reversed(layout)), list(reversed(per_bucket))

            dist._compute_bucket_assignment_by_size = settled
        try:
            self.__dict__["_ddp"] = DistributedDataParallel(self._module, init_sync=init_sync, **self._options)
        finally:
            dist._compute_bucket_assignment_by_size = compute
        self.__dict__["_layout"] = layout

    def bucket_layout(self) -> Optional[List[List[int]]]:
        """The parameter indices of each bucket, as the DDP reduces them now."""
        if self._ddp is None:
            return self._layout
        data = self._ddp._get_ddp_logging_data()
        if not data.get("has_rebuilt_buckets"):
            return self._layout
        return [[int(i) for i in bucket.split()] for bucket in data["rebuilt_per_bucket_param_indices"].split(",")]

    def release(self) -> None:
        """Drop the DDP of an aborted group. Its reducer's gradient hooks are removed
        now: the DDP may live on in reference cycles until the next gc, and its
        hooks must not fire into the aborted group."""
        if self._ddp is not None:
            self.__dict__["_layout"] = self.bucket_layout()
            self._ddp.reducer._remove_autograd_hooks()
        self.__dict__["_ddp"] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ddp(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_ddp"], name)


class DistributedWrappers:
    """The job's DDP wrappers (in creation order) and its tracked model, carried
    across epochs: released at an abort, rebuilt once the group is re-formed."""

    def __init__(self, kv: KeyValueStore) -> None:
        self._kv = kv
        self.ddps: List[RebuildableDDP] = []
        self.model: Any = None

    def wrap(self, model: Any, options: Dict[str, Any], epoch: int, replacement: bool,
             timeout: float) -> RebuildableDDP:
        """A new DDP of ``model``. A replacement skips DDP's initial broadcast (its
        state arrives from the buddies) and takes the layout the survivors published."""
        layout = None
        if replacement:
            key = keys.ddp_layout(epoch, len(self.ddps))
            self._kv.wait([key], timeout=timeout)
            layout = json.loads(self._kv.get(key))
        wrapper = RebuildableDDP(model, init_sync=epoch == 0, options=options, layout=layout)
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

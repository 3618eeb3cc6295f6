"""What the training's own distributed wrappers need after a recovery: a DDP
rebuilt on the re-formed group with the bucket layout it had settled on, and
FSDP2 modules reset onto the re-formed group."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.errors import AbortedError
from peerstate.state.training_state import model_parts
from peerstate.worker import torch_private


class RebuildableDDP:
    """A ``DistributedDataParallel`` (a subclass: ``isinstance`` holds, attribute
    reads and writes are the DDP's own) that the job rebuilds in place on each
    re-formed process group, so the script's reference stays valid. Made by
    ``new_rebuildable_ddp``: this class is mixed into DDP's there, so that
    ``import peerstate`` needs no torch.

    A rebuild runs DDP's constructor again on the same object. What the script
    changed survives it: ``require_backward_grad_sync`` and
    ``require_forward_param_sync`` (``no_sync()``, or set directly), ``train()`` /
    ``eval()``, the comm hook it registered, and attributes of its own. DDP
    reduces through a comm hook of peerstate's that runs the script's hook (or
    DDP's own scale-and-sum) and lets an abort fail what DDP waits for
    (``PendingReductions``); the script registers its hook as usual, once.

    Why the bucket layout is carried over: a fresh DDP reduces its first
    iteration in buckets laid out in parameter order and only then re-buckets
    by the order gradients became ready. Where a gradient element sits in a
    bucket decides the order gloo/NCCL sum it across ranks, so that first
    iteration would differ from a never-rebuilt DDP in the last bit (with 3 or
    more ranks). A rebuilt DDP is therefore built with the layout the old one
    had settled on, and a replacement receives it from the survivors.
    """

    CARRIED = ("require_backward_grad_sync", "require_forward_param_sync", "training")
    HOLD_THE_GROUP = ("reducer", "logger", "process_group")  # what a rebuild retires (see Retired)

    def __init__(self, module: Any, init_sync: bool, options: Dict[str, Any],
                 layout: Optional[List[List[int]]] = None) -> None:
        object.__setattr__(self, "_peerstate", {"module": module, "options": options, "layout": None,
                                                "released": False, "script_hook": None, "abortable": False,
                                                "reductions": PendingReductions(), "retired": []})
        self.rebuild(init_sync, layout)

    def rebuild(self, init_sync: bool = False, layout: Optional[List[List[int]]] = None) -> None:
        from torch.nn.parallel import DistributedDataParallel

        built = self._peerstate
        if "reducer" in self.__dict__:
            self.release()  # the old reducer's hooks must not stay beside the new one's
            built["retired"].append(Retired(built["reductions"],
                                            [self.__dict__.get(name) for name in self.HOLD_THE_GROUP]))
            built["reductions"] = PendingReductions()
        kept = {name: self.__dict__[name] for name in self.CARRIED if name in self.__dict__}
        def settled(params: Any, limits: List[int], *args: Any, **kwargs: Any) -> Tuple[list, list]:
            # DDP reverses what this returns, so hand it the layout reversed.
            per_bucket = [limits[min(i, len(limits) - 1)] for i in range(len(layout))]
            return list(reversed(layout)), list(reversed(per_bucket))

        with torch_private.ddp_bucket_assignment(settled) if layout else contextlib.nullcontext():
            DistributedDataParallel.__init__(self, built["module"], init_sync=init_sync, **built["options"])
        built.update(layout=layout, released=False)
        built["retired"] = [retired for retired in built["retired"] if not retired.quiet()]
        self.__dict__.update(kept)
        # DDP takes one comm hook: ours, which runs the script's (or DDP's allreduce) and
        # hands DDP a future an abort can fail. Where DDP registered one itself (its
        # mixed precision), the script's goes beside it as DDP allows, and an abort
        # cannot end a reduction that gloo leaves waiting (see PendingReductions).
        built["abortable"] = not self._comm_hooks
        if built["abortable"]:  # the script's hook, if any, runs inside ours
            DistributedDataParallel.register_comm_hook(self, None, self._abortable_reduction)
        elif built["script_hook"] is not None:
            DistributedDataParallel.register_comm_hook(self, *built["script_hook"])

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """DDP's ``register_comm_hook``: the hook runs in every epoch, its future
        wrapped so that an abort fails it (see ``PendingReductions``)."""
        from torch.nn.parallel import DistributedDataParallel

        built = self._peerstate
        if not built["abortable"]:
            DistributedDataParallel.register_comm_hook(self, state, hook)
            built["script_hook"] = (state, hook)
            return
        if built["script_hook"] is not None and built["script_hook"] != (state, hook):
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._check_comm_hook(hook)
        built["script_hook"] = (state, hook)

    def _abortable_reduction(self, state, bucket):  # noqa: ANN001 - DDP checks the annotations it finds
        """The comm hook DDP runs for each bucket (``state`` is unused). After an abort
        no reduction starts: it would only wait in the aborted group."""
        reductions = self._peerstate["reductions"]
        script = self._peerstate["script_hook"]
        return reductions.track(lambda: script[1](script[0], bucket) if script is not None
                                else _allreduce_mean(self.process_group, bucket))

    def abort_reductions(self) -> None:
        """Fail every bucket reduction DDP waits for now, and those it starts before
        the next rebuild (any thread)."""
        self._peerstate["reductions"].abort()

    def bucket_layout(self) -> Optional[List[List[int]]]:
        """The parameter indices of each bucket, as the DDP reduces them now."""
        built = self._peerstate
        if built["released"]:
            return built["layout"]
        data = self._get_ddp_logging_data()
        if not data.get("has_rebuilt_buckets"):
            return built["layout"]
        return [[int(i) for i in bucket.split()] for bucket in data["rebuilt_per_bucket_param_indices"].split(",")]

    def in_flight(self) -> int:
        """Bucket reductions of aborted groups still running in gloo (see ``Retired``)."""
        return sum(retired.reductions.running() for retired in self._peerstate["retired"])

    def drop_retired(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (the GIL released) for the aborted groups'
        reductions to end, then let go of what they hold; False if some still run
        (those are kept)."""
        retired = self._peerstate["retired"]
        deadline = time.monotonic() + timeout
        for entry in retired:
            entry.reductions.wait_quiet(deadline - time.monotonic())
        self._peerstate["retired"] = [entry for entry in retired if not entry.quiet()]
        return not self._peerstate["retired"]

    def release(self) -> None:
        """Detach from an aborted group until the next rebuild. Its reducer's gradient
        hooks are removed now: they must not fire into the aborted group."""
        built = self._peerstate
        if not built["released"]:
            built["layout"] = self.bucket_layout()
            self.reducer._remove_autograd_hooks()
            built["released"] = True


def _allreduce_mean(group: Any, bucket: Any) -> Any:
    """What DDP does without a comm hook: scale by 1 / group size (a multiplication,
    as DDP's reducer scales, so the bits are the same), then sum across the group."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda done: done.value()[0])


class PendingReductions:
    """The futures a DDP waits on for its buckets' reductions, each standing for the
    reduction's own, so that ``abort()`` can fail them. DDP's backward waits on them
    in C++, where no socket shutdown reaches a gloo receive that was part way
    through a message when its peer died, or a send part way written: gloo's tcp
    pair, when it fails, wakes the operations still pending but not the ones in
    progress, which then wait out the group's timeout (``process_groups``; pinned by
    ``tests/worker/test_process_groups.py``). Failed here, the backward raises at
    once; the reduction itself runs on in its group's thread until that timeout, and
    ``running()`` counts it until its callbacks (Python: they need the GIL) have run.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pending: Set[Any] = set()
        self._aborted = False
        self._running = 0
        self._last_end = 0.0  # time.monotonic() when the last reduction's callbacks ended

    def track(self, start: Callable[[], Any]) -> Any:
        """A future completed with the result of the reduction ``start()`` returns (a
        future), or failed by ``abort()``; after an abort ``start`` is not called."""
        import torch

        standing = torch.futures.Future()
        with self._lock:
            if self._aborted:
                standing.set_exception(AbortedError("the group of this reduction was aborted"))
                return standing
            self._pending.add(standing)
            self._running += 1
        try:
            reduction = start()
        except BaseException:
            with self._lock:
                self._pending.discard(standing)
                self._ended()
            raise

        def settle(done: Any) -> None:
            try:
                with self._lock:
                    if standing not in self._pending:
                        return  # failed by abort() already
                    self._pending.discard(standing)
                try:
                    standing.set_result(done.value())
                except Exception as error:  # noqa: BLE001 - the reduction's own failure, passed on
                    standing.set_exception(error)
            finally:
                with self._lock:
                    self._ended()

        reduction.add_done_callback(settle)
        return standing

    def _ended(self) -> None:
        self._running -= 1
        self._last_end = time.monotonic()
        self._lock.notify_all()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            pending, self._pending = self._pending, set()
        for standing in pending:  # outside the lock: DDP's callbacks run in here
            standing.set_exception(AbortedError("the group of this reduction was aborted"))

    def running(self) -> int:
        with self._lock:
            return self._running

    def quiet(self) -> bool:
        """No reduction runs, nor ended in the last ``QUIET_SECONDS``."""
        with self._lock:
            return self._running == 0 and time.monotonic() - self._last_end >= QUIET_SECONDS

    def wait_quiet(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (the GIL released) until ``quiet()``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                now = time.monotonic()
                still = QUIET_SECONDS - (now - self._last_end) if self._running == 0 else deadline - now
                if self._running == 0 and still <= 0:
                    return True
                if now >= deadline:
                    return False
                self._lock.wait(min(still, deadline - now))


QUIET_SECONDS = 1.0  # after a reduction's callbacks ran, its gloo thread may still drop them (needs the GIL)


class Retired:
    """An aborted DDP's reducer, logger and process group, held after a rebuild until
    the reductions they started have ended (``PendingReductions.quiet``).

    Why: a bucket reduction the abort failed but gloo still runs (a send part way
    written to a dead peer ends only at the group's timeout) runs Python callbacks
    when it ends, which need the GIL. The last reference to a gloo group, dropped,
    runs the group's destructor, which waits for the group's threads in the thread
    that dropped it, holding the GIL: the process would stop for good. Dropped at the
    interpreter's exit instead, the reduction's end met callbacks that could no
    longer run and std::terminate ended the process (exit -6, after a job that
    finished within the group's timeout of a recovery; ``tests/worker/
    test_rebuild.py``)."""

    def __init__(self, reductions: PendingReductions, holders: List[Any]) -> None:
        self.reductions = reductions
        self._holders = holders

    def quiet(self) -> bool:
        return self.reductions.quiet()


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
            layout = self.published_layout(epoch, index, timeout)
        wrapper = new_rebuildable_ddp(model, init_sync=epoch == 0, options=options, layout=layout)
        self.ddps.append(wrapper)
        return wrapper

    def published_layout(self, epoch: int, index: int, timeout: float) -> List[List[int]]:
        """The bucket layout of DDP number ``index`` that epoch ``epoch``'s survivors
        published (``release``); blocks until one did, up to ``timeout`` (then TimeoutError).
        Two requests to the job's store: a wait and a read."""
        key = keys.ddp_layout(epoch, index)
        self._kv.wait([key], timeout=timeout)
        return json.loads(self._kv.get(key))

    def release(self) -> None:
        """Drop every DDP of the aborted group (their layouts stay, for ``publish_layouts``)."""
        for wrapper in self.ddps:
            wrapper.release()

    def publish_layouts(self, epoch: int, rank: int, kept_state: Iterable[int]) -> bool:
        """Publish every DDP's bucket layout for epoch ``epoch``'s replacements, if ``rank``
        is the lowest of ``kept_state``, the members of its node that kept their state:
        one request per node (DDP agrees on one layout across ranks; the first node's
        stands). True when this rank published."""
        if not self.ddps or rank != min(kept_state, default=None):
            return False
        for index, wrapper in enumerate(self.ddps):
            self._kv.compare_set(keys.ddp_layout(epoch, index), b"", json.dumps(wrapper.bucket_layout()).encode())
        return True

    def abort(self, new_epoch: int) -> None:
        """Fail the bucket reductions every DDP waits for (an AbortHandler step)."""
        for wrapper in list(self.ddps):
            wrapper.abort_reductions()

    def rebuild(self) -> None:
        for wrapper in self.ddps:
            wrapper.rebuild(init_sync=False, layout=wrapper.bucket_layout())
        reset_fsdp(self.model)

    def close(self, timeout: float) -> None:
        """Release every DDP, and let go of the aborted groups their rebuilds retired
        once those groups' reductions ended (waiting up to ``timeout`` seconds; a group
        still busy then is left to the interpreter's exit)."""
        for wrapper in self.ddps:
            wrapper.release()
        deadline = time.monotonic() + timeout
        for wrapper in self.ddps:
            wrapper.drop_retired(deadline - time.monotonic())


def reset_fsdp(model: Any) -> None:
    """After an abort, FSDP2 (``fully_shard``) modules: drop the aborted iteration
    (``reset_iter_state``: in-flight collectives, unsharded parameters, per-iteration
    trackers) and point their cached process groups (shard and, with HSDP, replicate)
    at the re-formed groups. Their device mesh finds groups by name, and a re-formed
    group has the old one's (see ``meshes``). ``model``: a module or a list of model
    parts, each reset."""
    for part in model_parts(model):
        if hasattr(part, "reset_iter_state"):
            _reset_fsdp_part(part)


def _reset_fsdp_part(model: Any) -> None:
    infos = {}
    for module in model.modules():
        group = torch_private.fsdp_param_group(module)
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
    if not torch_private.fsdp_ran(model):
        # Never ran an iteration (a replacement whose first step a regroup came before): it
        # has no iteration state, and FSDP's reset would read a comm context not yet made.
        return
    try:
        model.reset_iter_state()
    except Exception:  # noqa: BLE001 - it waits on the aborted iteration's collectives, which
        model.reset_iter_state()  # failed; the first call cleared them, the second finishes the reset

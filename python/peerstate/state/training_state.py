"""The training state as buffers and objects: a model's and an optimizer's state
(registered with a SnapshotStore in one call), and the RNG states.

Tensors are registered as buffers, in place: ``model.state_dict()`` and
``optimizer.state_dict()`` return the live tensors, so a snapshot copies them
and a restore writes back into them. Non-tensor optimizer state (learning
rates and other hyperparameters of each param group, scalar per-parameter
state) is registered as eager Python state.

Optimizer state such as Adam's moments is created lazily by the first
``optimizer.step()``: register after it, or register again once it exists.

Sharded state (FSDP2's ``fully_shard``, any DTensor) is registered as this
rank's local shard: each rank snapshots and replicates its own shard, and a
replacement receives the failed rank's.

Trainers hand DCP containers: model parts as a list (pipeline stages), one
optimizer per part in a container (torchtitan's ``OptimizersContainer``, an
``Optimizer`` whose own ``state`` stays empty, its state in ``.optimizers``).
Both are taken apart here (``model_parts``, ``optimizer_parts``) and each part
registered in place; an optimizer whose state cannot be found that way is
refused by name (``check_optimizer_state``), never registered as nothing.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from peerstate.errors import InvalidArgumentError
from peerstate.state.snapshot import SnapshotStore


def register_training_state(
    store: SnapshotStore,
    model: Optional[Any] = None,
    optimizer: Optional[Any] = None,
    prefix: str = "",
) -> List[str]:
    """Register every tensor of ``model.state_dict()`` and ``optimizer.state_dict()``.

    Names are ``{prefix}model/{key}``, ``{prefix}optimizer/state/{index}/{key}``
    and ``{prefix}optimizer/param_groups``. Returns the names registered.
    """
    tensors, objects = training_state(model, optimizer, prefix)
    store.register_many(tensors)
    for name, (get, set_) in objects.items():
        store.register_object(name, get, set_)
    return [*tensors, *objects]


def training_state(
    model: Optional[Any] = None,
    optimizer: Optional[Any] = None,
    prefix: str = "",
) -> Tuple[Dict[str, Any], Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]]]:
    """What ``register_training_state`` registers: name -> live tensor, and name ->
    (get, set) of the eager Python state, for a caller that spreads them over
    several stores."""
    import torch

    def local(value: Any) -> Any:
        # A DTensor's to_local() is its live local shard (same storage).
        return value.to_local() if hasattr(value, "to_local") and hasattr(value, "device_mesh") else value

    tensors: Dict[str, Any] = {}
    objects: Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]] = {}
    models = model_parts(model)
    for index, part in enumerate(models):
        where = f"{prefix}model/" if len(models) == 1 else f"{prefix}model/{index}/"
        for key, value in part.state_dict().items():
            if isinstance(value, torch.Tensor):
                tensors[f"{where}{key}"] = local(value)
    optimizers = optimizer_parts(optimizer)
    for index, part in enumerate(optimizers):
        where = f"{prefix}optimizer/" if len(optimizers) == 1 else f"{prefix}optimizer/{index}/"
        _optimizer_state(part, where, local, tensors, objects)
    return tensors, objects


def model_parts(model: Any) -> List[Any]:
    """The modules of ``model``: itself, or each of a list of model parts."""
    if model is None:
        return []
    return [m for part in model for m in model_parts(part)] if isinstance(model, (list, tuple)) else [model]


def optimizer_parts(optimizer: Any) -> List[Any]:
    """The optimizers whose ``state`` holds the state: ``optimizer`` itself, each of a
    list, or each of a container's ``.optimizers`` (torchtitan's OptimizersContainer)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return [o for part in optimizer for o in optimizer_parts(part)]
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, (list, tuple)) and inner:
        return optimizer_parts(list(inner))
    return [optimizer]


def check_optimizer_state(optimizer: Any) -> None:
    """Refuse, naming it, an optimizer part whose ``state`` holds no tensor once it has
    stepped while its ``state_dict()`` holds some: its state lives where it cannot be
    registered in place (a container of another shape), and registering its empty
    ``state`` would make every restore silently skip it. A stateless optimizer (SGD
    without momentum: no tensor either way) passes."""
    import torch

    for part in optimizer_parts(optimizer):
        if any(isinstance(v, torch.Tensor) for state in part.state.values() for v in state.values()):
            continue
        held = [v for state in part.state_dict().get("state", {}).values() if isinstance(state, dict)
                for v in state.values() if isinstance(v, torch.Tensor)]
        if held:
            raise InvalidArgumentError(
                f"the optimizer {type(part).__name__} holds no tensor in its .state after its first step, but its "
                f"state_dict() holds {len(held)}: its state lives in optimizers it contains, which peerstate cannot "
                "see, and a restore would leave them as they are. Hand those optimizers instead "
                "(track(optimizer=[...]), or a container with an .optimizers list, as torchtitan's "
                "OptimizersContainer)")


def _optimizer_state(optimizer: Any, where: str, local: Callable[[Any], Any], tensors: Dict[str, Any],
                     objects: Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]]) -> None:
    import torch

    # Index the live state by the parameters' positions, as state_dict() does,
    # but keep references to the live tensors rather than to a packed copy.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scalars = {}
    for index, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            name = f"{where}state/{index}/{key}"
            if isinstance(value, torch.Tensor):
                tensors[name] = local(value)
            else:
                scalars[(index, key)] = value

    def get_groups() -> Any:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state = {(i, k): optimizer.state[params[i]][k] for (i, k) in scalars}
        return groups, state

    def set_groups(value: Any) -> None:
        groups, state = value
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
        for (i, k), v in state.items():
            optimizer.state[params[i]][k] = v

    objects[f"{where}param_groups"] = (get_groups, set_groups)


def capture_rng() -> Dict[str, Any]:
    """The RNG states of Python, NumPy (if imported), torch and CUDA (if initialised),
    pickled every step: torch's as bytes, since a tensor pickles through
    torch.save (~15x slower for these 5 KB)."""
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state().numpy().tobytes()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def rng_fingerprint() -> Dict[str, Any]:
    """``capture_rng()`` in a form ``==`` compares (NumPy's key is an array), to see
    whether a generator moved; cheaper than pickling it."""
    state = capture_rng()
    if "numpy" in state:
        kind, key, position, has_gauss, cached = state["numpy"]
        state["numpy"] = (kind, key.tobytes(), position, has_gauss, cached)
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    """Set the RNG states that ``capture_rng`` returned."""
    import torch

    def tensor(raw: bytes) -> Any:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    random.setstate(state["python"])
    torch.set_rng_state(tensor(state["torch"]))
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])

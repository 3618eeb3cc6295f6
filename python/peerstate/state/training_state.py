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
"""

from __future__ import annotations

import random
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

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
    if model is not None:
        for key, value in model.state_dict().items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}model/{key}"] = local(value)
    if optimizer is not None:
        # Index the live state by the parameters' positions, as state_dict() does,
        # but keep references to the live tensors rather than to a packed copy.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scalars = {}
        for index, param in enumerate(params):
            for key, value in optimizer.state.get(param, {}).items():
                name = f"{prefix}optimizer/state/{index}/{key}"
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

        objects[f"{prefix}optimizer/param_groups"] = (get_groups, set_groups)
    return tensors, objects


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

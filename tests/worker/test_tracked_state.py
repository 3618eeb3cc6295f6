"""What a restore gives back beyond the tensors, on the real SnapshotStore: plain
values tracked as extras, and no gradients of the step it rolls back."""

import pytest

torch = pytest.importorskip("torch")

from peerstate import InvalidArgumentError  # noqa: E402
from peerstate.worker.tracked_state import TrackedState  # noqa: E402


class Counter:
    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


@pytest.fixture
def tracked():
    state = TrackedState([0], k=1, share_count=None, versions=4, threads=1)
    yield state
    state.close()


def snapshot(tracked, version):
    tracked.own.snapshot(version).wait()


def test_plain_extras_are_restored_where_the_script_reads_them(tracked):
    counter = Counter()
    model = torch.nn.Linear(2, 2)
    tracked.track(model=model, optimizer=None, scheduler=None, loader=None,
                  extras={"best_loss": float("inf"), "history": [], "counter": counter}, data_parallel=False)
    tracked.register(0)
    tracked.extras["best_loss"] = 0.5
    tracked.extras["history"].append(0.5)
    counter.value = 7
    snapshot(tracked, 1)
    tracked.extras["best_loss"] = 0.25
    tracked.extras["history"].append(0.25)  # a mutable value is captured by value, not by reference
    counter.value = 9
    tracked.restore(1)
    assert tracked.extras["best_loss"] == 0.5 and tracked.extras["history"] == [0.5]
    assert tracked.extras["counter"] is counter and counter.value == 7


def test_an_extra_that_can_be_neither_pickled_nor_loaded_is_refused_at_track(tracked):
    with pytest.raises(InvalidArgumentError, match=r"extras=\{'stream': \.\.\.\}\): a generator has no state_dict"):
        tracked.track(model=None, optimizer=None, scheduler=None, loader=None, extras={"stream": (i for i in [])},
                      data_parallel=False)


def test_a_restore_leaves_no_gradient_of_the_step_it_rolls_back(tracked):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracked.track(model=model, optimizer=optimizer, scheduler=None, loader=None, extras={}, data_parallel=False)
    tracked.register(0)
    snapshot(tracked, 1)
    model(torch.ones(1, 2)).sum().backward()  # the aborted step's backward
    assert all(p.grad is not None for p in model.parameters())
    tracked.restore(1)
    assert all(p.grad is None for p in model.parameters())


def test_a_seed_set_after_a_restore_is_seen_once(tracked):
    tracked.remember_rng()
    assert not tracked.rng_changed()  # untouched since the restore (and forgotten: checked once)
    tracked.remember_rng()
    torch.manual_seed(1234)
    assert tracked.rng_changed() == ["torch"]  # named, for the finding: which generator moved
    assert not tracked.rng_changed()


def test_under_hsdp_each_rank_snapshots_its_replica_sets_state_whole_and_says_so():
    # ("replicate", "shard") = 2 x 2 on 2 nodes of 2: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1,
    # each pair on two nodes, so each member keeps a full copy of its set's state (one share per set)
    state = TrackedState([0, 0, 1, 1], k=1, share_count=None, versions=4, threads=1)
    try:
        model = torch.nn.Linear(4, 4)
        state.track(model=model, optimizer=None, scheduler=None, loader=None, extras={}, data_parallel=True,
                    replica_mesh=(2, 2), replica_dim=0)
        assert (state.layout.share_count, state.layout.replica_mesh, state.layout.replica_dim) == (1, (2, 2), 0)
        assert [state.shares.share_of(r) for r in range(4)] == [0, 1, 0, 1]
        state.register(3)
        assert len(state.share_stores) == 1 and state.own_share(3) is state.share_stores[0]
        assert sorted(state.share_stores[0].owners()) == ["model/bias", "model/weight"]  # the shard, whole
        assert "model/weight" not in state.own.owners()
    finally:
        state.close()


def test_a_share_count_a_replica_set_cannot_hold_is_refused_at_track():
    state = TrackedState([0, 0, 1, 1], k=1, share_count=2, versions=4, threads=1)
    try:
        with pytest.raises(InvalidArgumentError, match="between 1 and the members a replica set has on a node"):
            state.track(model=None, optimizer=None, scheduler=None, loader=None, extras={}, data_parallel=True,
                        replica_mesh=(2, 2), replica_dim=0)
    finally:
        state.close()


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's shape: one optimizer per model part in ``.optimizers``; the container is
    an Optimizer itself (for its hooks), over every parameter, and its own ``state`` stays
    empty. ``hide`` keeps them under another name: a container peerstate cannot see into."""

    def __init__(self, parts, hide=False):
        inner = [torch.optim.AdamW(part.parameters(), lr=0.1) for part in parts]
        if hide:
            self._inner = inner
        else:
            self.optimizers = inner
        torch.optim.Optimizer.__init__(self, [p for part in parts for p in part.parameters()], {"lr": 0.1})

    def step(self, closure=None):
        for optimizer in getattr(self, "optimizers", None) or self._inner:
            optimizer.step()

    def state_dict(self):
        return {"state": {f"{i}/{k}": v for i, o in enumerate(getattr(self, "optimizers", None) or self._inner)
                          for k, v in o.state_dict()["state"].items()}}


def train_one_step(parts, optimizer):
    x = torch.randn(4, 3)
    for part in parts:
        x = part(x)
    x.sum().backward()
    optimizer.step()


def test_model_parts_and_an_optimizer_container_are_registered_part_by_part_and_restored(tracked, capsys):
    torch.manual_seed(0)
    parts = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)]
    container = OptimizersContainer(parts)
    tracked.track(model=parts, optimizer=container, scheduler=None, loader=None, extras={}, data_parallel=False)
    train_one_step(parts, container)
    tracked.register(0)
    names = tracked.own.native.buffer_names()
    moments = [n for n in names if n.startswith("optimizer/") and "/state/" in n]
    assert len(moments) == 12, names  # 2 optimizers x 2 parameters x (step, exp_avg, exp_avg_sq): not 0
    assert {"model/0/weight", "model/1/bias"} <= set(names), names
    said = capsys.readouterr().err  # once, in the worker's log: which path each object takes
    assert "tracks model (2 parts, 4 tensors in place); optimizer (2 parts, 12 tensors in place)" in said, said
    snapshot(tracked, 1)
    saved = [{k: v.clone() for k, v in s.items()} for o in container.optimizers for s in o.state.values()]
    train_one_step(parts, container)
    tracked.restore(1)
    restored = [s for o in container.optimizers for s in o.state.values()]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(saved, restored) for k in a)


def test_a_container_whose_optimizers_cannot_be_found_is_refused_by_name_not_registered_as_nothing(tracked):
    parts = [torch.nn.Linear(3, 3)]
    container = OptimizersContainer(parts, hide=True)
    tracked.track(model=parts, optimizer=container, scheduler=None, loader=None, extras={}, data_parallel=False)
    train_one_step(parts, container)
    with pytest.raises(InvalidArgumentError, match=r"the optimizer OptimizersContainer holds no tensor in its \.state "
                                                   r"after its first step, but its state_dict\(\) holds 6"):
        tracked.register(0)


def test_a_stateless_optimizer_is_not_refused(tracked):
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state at all
    tracked.track(model=model, optimizer=optimizer, scheduler=None, loader=None, extras={}, data_parallel=False)
    train_one_step([model], optimizer)
    tracked.register(0)
    assert not [n for n in tracked.own.native.buffer_names() if n.startswith("optimizer/state")]

"""The fault injector: spec parsing, the reproducible random schedule, when faults
fall due, and a real job whose fault is injected by its agent."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from peerstate import InvalidArgumentError
from peerstate.launcher.inject import FaultInjector, parse
from peerstate.launcher.processes import WorkerProcess


def test_specs_parse():
    [kill] = parse("kill:rank=2:step=10", world_size=4, nnodes=2)
    assert (kill.kind, kill.rank, kill.step, kill.time) == ("kill", 2, 10, None)
    [hang] = parse("hang:rank=1:time=2.5", world_size=4, nnodes=2)
    assert (hang.kind, hang.rank, hang.time) == ("hang", 1, 2.5)
    [node] = parse("kill-node:node=1:step=20", world_size=4, nnodes=2)
    assert (node.kind, node.node) == ("kill-node", 1)
    [spare] = parse("kill-spare:node=0:time=12", world_size=4, nnodes=2)
    assert (spare.kind, spare.node, spare.time) == ("kill-spare", 0, 12.0)


@pytest.mark.parametrize("spec, message", [
    ("explode:rank=1:step=2", "the kind must be one of"),
    ("kill:rank=9:step=2", r"rank=R with R in 0\.\.3"),
    ("kill:rank=1", "exactly one of step=N or time=SECONDS"),
    ("kill:rank=1:step=2:time=3", "exactly one of"),
    ("kill-node:node=5:step=1", r"node=N with N in 0\.\.1"),
    ("kill:rank:step=1", "is not key=value"),
    ("kill:rank=one:step=1", "invalid literal"),
    ("random:seed=1", "mtbf=SECONDS > 0"),
    ("random:mtbf=5:kinds=kill,melt", "unknown kinds"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse(spec, world_size=4, nnodes=2)


def test_random_schedule_is_reproducible_and_bounded():
    a = parse("random:mtbf=10:seed=7:max=5:kinds=kill,hang,kill-node", world_size=8, nnodes=2)
    b = parse("random:mtbf=10:seed=7:max=5:kinds=kill,hang,kill-node", world_size=8, nnodes=2)
    c = parse("random:mtbf=10:seed=8:max=5:kinds=kill,hang,kill-node", world_size=8, nnodes=2)
    assert [(f.kind, f.rank, f.node, f.time) for f in a] == [(f.kind, f.rank, f.node, f.time) for f in b]
    assert [f.time for f in a] != [f.time for f in c]
    assert len(a) == 5 and all(x.time < y.time for x, y in zip(a, a[1:]))
    assert all((f.node is not None) == (f.kind == "kill-node") for f in a)
    assert sum(f.kind == "kill-node" for f in a) <= 1  # of 2 nodes, one can be killed: the job needs the other


def test_random_sequences_land_as_two_faults_of_one_scenario_on_the_right_victims():
    # 2 nodes of 2: rank r's buddy is the rank with its local index on the other node
    buddy = {0: 2, 1: 3, 2: 0, 3: 1}
    for kind in ("kill-in-recovery", "hang-then-kill-buddy", "kill-with-buddy"):
        faults = parse(f"random:mtbf=5:seed=3:max=6:kinds={kind}", world_size=4, nnodes=2)
        assert len(faults) == 12 and [f.scenario for f in faults] == [i // 2 for i in range(12)]
        for first, second in zip(faults[::2], faults[1::2]):
            assert first.scenario_kind == second.scenario_kind == kind
            delay = second.time - first.time
            if kind == "kill-in-recovery":
                assert (first.kind, second.kind) == ("kill", "kill") and first.rank != second.rank
                assert 0.05 <= delay <= 0.3
            elif kind == "hang-then-kill-buddy":
                assert (first.kind, second.kind) == ("hang", "kill") and second.rank == buddy[first.rank]
                assert 0.2 <= delay <= 0.6
            else:
                assert (first.kind, second.kind) == ("kill", "kill") and second.rank == buddy[first.rank]
                assert delay == 0


def test_a_spare_kill_waits_for_a_ready_spare_and_scenarios_are_numbered_across_specs():
    injector = FaultInjector(["kill-spare:node=0:time=1", "random:mtbf=1:seed=1:max=2:kinds=kill-with-buddy"],
                             world_size=4, nnodes=2, node=0)
    assert [f.scenario for f in injector.faults] == [0, 1, 1, 2, 2]
    assert injector.due({}, 5.0, spares_waiting=0) == []  # no spare ready yet: it waits for one
    [due] = injector.due({}, 5.0, spares_waiting=1)
    assert (due.kind, due.node) == ("kill-spare", 0)


def test_faults_fall_due_once_on_the_node_that_runs_the_rank():
    node0 = FaultInjector(["kill:rank=1:step=5", "kill-node:node=1:time=3", "hang:rank=3:time=2"],
                          world_size=4, nnodes=2, node=0)
    assert node0.due({0: 9, 1: 4}, None) == []
    [due] = node0.due({0: 9, 1: 5}, None)
    assert (due.kind, due.rank) == ("kill", 1)
    assert node0.due({0: 9, 1: 6}, 10.0) == []  # injected already; node 1 and rank 3 are not here
    node1 = FaultInjector(["kill-node:node=1:time=3", "hang:rank=3:time=2"], world_size=4, nnodes=2, node=1)
    assert node1.due({2: 1, 3: 1}, 1.0) == []  # nothing before its time
    assert sorted(f.kind for f in node1.due({2: 1, 3: 1}, 3.5)) == ["hang", "kill-node"]


def test_a_fault_on_a_worker_whose_group_is_gone_lands_on_nothing_and_does_not_stop_the_agent():
    """kill-node signals every process group the agent holds; one whose worker died and
    was reaped since the last poll is gone (ESRCH). That once ended the agent with
    'lost the store' before it could kill itself (soak seed 13)."""
    worker = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    worker.wait(timeout=60)
    assert not WorkerProcess.signal_group(SimpleNamespace(popen=worker), signal.SIGKILL)  # no ProcessLookupError
    with pytest.raises(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGKILL)  # what it would have raised

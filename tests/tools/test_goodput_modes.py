"""Goodput per redundancy mode (``tools.goodput_modes``): a mode's memory decides
whether it fits, its traffic and pipeline what the step pays, the nodes its copies
depend on how often a failure goes to disk; the modes come from the benchmarks'
result files."""

import json

import pytest

from peerstate.tools.goodput import GoodputInputs, closed_form
from peerstate.tools.goodput_modes import JobShape, RedundancyMode, fits, mode_row, modes_from_results, overhead

INPUTS = GoodputInputs(peerstate_overhead=0.02, step_s=6.0)
SHAPE = JobShape(state_gb=30.0, host_gb=100.0, network_gb_s=10.0, copy_gb_s=20.0)


def mode(versions=4, memory_x=4.0, exposed=1, pushed_x=1.0):
    return RedundancyMode("m", memory_x, pushed_x, 0.5, versions, exposed)


def test_a_mode_fits_when_its_memory_in_shards_times_the_state_fits_the_host():
    assert fits(SHAPE, mode(memory_x=3.3)) and not fits(SHAPE, mode(memory_x=3.4))  # 99 GB, 102 GB of 100
    row = mode_row(INPUTS, SHAPE, mode(memory_x=6.0), 1024)
    assert row["goodput"] is None and row["memory_gb"] == pytest.approx(180.0)
    assert row["restart"] == pytest.approx(closed_form(INPUTS, 1024)["checkpoint-restart"])  # the job's fallback


def test_the_pipeline_says_what_of_the_copy_and_the_push_the_step_waits_for():
    # 30 GB: a 1.5 s copy, a 3 s push; a 6 s step. Lazy (4): neither (the copy has a
    # forward and backward, the push a whole step). Eager (3): the copy. Synced (2): what
    # of the copy and then the push outlasts a forward (a third of the step, 2 s): 2.5 s.
    assert overhead(INPUTS, SHAPE, mode(4)) == pytest.approx(0.02)
    assert overhead(INPUTS, SHAPE, mode(3)) == pytest.approx(0.02 + 1.5 / 6.0)
    assert overhead(INPUTS, SHAPE, mode(2)) == pytest.approx(0.02 + 2.5 / 6.0)
    light = mode(2, pushed_x=0.1)  # a 0.3 s push: copy and push end inside the forward
    assert overhead(INPUTS, SHAPE, light) == pytest.approx(0.02)
    slow = mode(4, pushed_x=3.0)  # a 9 s push outlasts even the lazy pipeline's step, by 3 s
    assert overhead(INPUTS, SHAPE, slow) == pytest.approx(0.02 + 3.0 / 6.0)


def test_a_group_depending_on_more_nodes_goes_to_disk_more_often():
    # Same memory, traffic and recovery: parity g=8 (7 other nodes) loses a little more
    # than g=4 (3) and a buddy (1), at a size where the window matters.
    big = dict(INPUTS.__dict__, correlated=0.0, window_s=3600.0)
    inputs = GoodputInputs(**big)
    goodputs = [mode_row(inputs, SHAPE, mode(exposed=e, memory_x=2.0), 65536)["goodput"] for e in (1, 3, 7)]
    assert goodputs[0] > goodputs[1] > goodputs[2], goodputs


def test_the_modes_come_from_the_benchmarks_results(tmp_path):
    assert modes_from_results(tmp_path) == []  # not run yet: no table, said by bench/goodput.py
    rows = [dict(mode=name, size_mib=1024, memory_x=x4, memory_synced_x=x2, pushed_x=1.0)
            for name, x4, x2 in (("buddies k=1", 6.0, 4.0), ("parity g=4 m=1", 4.67, 2.67),
                                 ("parity g=8 m=1", 4.29, 2.29))]
    (tmp_path / "redundancy.json").write_text(json.dumps({"rows": rows}))
    for name, seconds in (("recovery_replicated_one_per_node.json", 0.35), ("recovery_parity4.json", 0.77)):
        (tmp_path / name).write_text(json.dumps({"rows": [{"phase": "kill to first step", "ours_s": seconds}]}))
    modes = {m.name: m for m in modes_from_results(tmp_path)}
    assert sorted(modes) == ["buddies k=1, 2 versions", "buddies k=1, 4 versions", "parity g=4, 2 versions",
                             "parity g=4, 4 versions", "parity g=8, 2 versions", "parity g=8, 4 versions"]
    assert modes["parity g=4, 2 versions"] == RedundancyMode("parity g=4, 2 versions", 2.67, 1.0, 0.77, 2, 3)
    assert modes["buddies k=1, 4 versions"] == RedundancyMode("buddies k=1, 4 versions", 6.0, 1.0, 0.35, 4, 1)
    assert modes["parity g=8, 2 versions"].recovery_s == 0.77  # g=8 not measured: g=4's stands in
    (tmp_path / "recovery_parity8.json").write_text(json.dumps({"rows": [{"phase": "kill to first step",
                                                                           "ours_s": 0.9}]}))
    assert {m.name: m for m in modes_from_results(tmp_path)}["parity g=8, 4 versions"].recovery_s == 0.9

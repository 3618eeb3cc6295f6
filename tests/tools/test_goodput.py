"""The goodput model against hand-computed cases, the published figures it is fed,
and its Monte-Carlo check."""

import math

import pytest

from peerstate.tools.goodput import (GoodputInputs, buddy_loss_probability, checkpoint_interval, closed_form,
                               monte_carlo)


def test_llama3_failure_rate():
    inputs = GoodputInputs()
    # 419 interruptions / (54 days * 24 h * 16,384 GPUs) = 1.973e-5 per GPU-hour
    assert inputs.rate_per_accelerator * 3600 == pytest.approx(419 / (54 * 24 * 16384))
    assert inputs.mtbf(16384) / 3600 == pytest.approx(54 * 24 / 419)  # 3.09 h


def test_young_interval_and_goodput_by_hand():
    # 1 failure per 10,000 s job-wide, 50 s stalls, 500 s restarts
    inputs = GoodputInputs(interruptions=1, days=10_000 / 86400, accelerators_observed=1,
                           checkpoint_stall_s=50, restart_s=500)
    assert inputs.mtbf(1) == pytest.approx(10_000)
    assert checkpoint_interval(inputs, 1) == pytest.approx(1000)  # sqrt(2 * 50 * 10,000)
    # 1 - 50/1000 - (500 + 500)/10,000 = 0.85
    assert closed_form(inputs, 1)["checkpoint-restart"] == pytest.approx(0.85)


def test_in_memory_and_peerstate_by_hand():
    inputs = GoodputInputs(interruptions=1, days=10_000 / 86400, accelerators_observed=1, step_s=2,
                           lag_steps=1.5, in_memory_restart_s=120, peerstate_recovery_s=1.0,
                           peerstate_overhead=0.02, correlated=0.0, window_s=0.0, comm_init_ref_s=0.0)
    values = closed_form(inputs, 1)
    assert values["in-memory restart (HyperPod)"] == pytest.approx(0.98 * (1 - 123 / 10_000))
    assert buddy_loss_probability(inputs) == 0.0
    # q = 0: no disk fallback at all, so no checkpoint stall either
    assert values["peerstate"] == pytest.approx(0.98 * (1 - 4 / 10_000), rel=1e-6)


def test_buddy_loss_probability_by_hand():
    inputs = GoodputInputs(correlated=0.01, k=1, window_s=60, accelerators_per_node=8)
    node_rate = inputs.rate_per_accelerator * 8
    assert buddy_loss_probability(inputs) == pytest.approx(1 - 0.99 * math.exp(-node_rate * 60))


def test_checkpoint_restart_at_llama3_scale_is_about_90_percent():
    assert closed_form(GoodputInputs(), 16384)["checkpoint-restart"] == pytest.approx(0.90, abs=0.01)


def test_monte_carlo_agrees_with_the_closed_forms():
    inputs = GoodputInputs(peerstate_recovery_s=0.5, peerstate_overhead=0.03)
    closed = closed_form(inputs, 16384)
    simulated = monte_carlo(inputs, 16384, days=200, seed=3)
    for strategy in ("checkpoint-restart", "in-memory restart (HyperPod)", "peerstate"):
        assert simulated[strategy] == pytest.approx(closed[strategy], abs=0.01), strategy
    # buddy losses: correlated (1%) plus rare independent ones
    assert 0 < simulated["buddy_losses"] < 0.05 * simulated["failures"]


def test_monte_carlo_buddy_losses_match_the_closed_form_probability():
    # a one-day window before a replacement holds its copies: losses become common enough to count
    inputs = GoodputInputs(correlated=0.0, window_s=86400.0)
    simulated = monte_carlo(inputs, 100_000, days=60, seed=1)
    expected = simulated["failures"] * buddy_loss_probability(inputs)
    assert expected > 5
    assert 0.5 * expected < simulated["buddy_losses"] < 2 * expected
    none = monte_carlo(GoodputInputs(correlated=0.0, window_s=0.0), 100_000, days=60, seed=1)
    assert none["failures"] == simulated["failures"] and none["buddy_losses"] == 0


def test_recovery_time_at_a_size_adds_the_measured_growth_of_the_control_plane(tmp_path):
    import json

    from peerstate.tools.goodput import GoodputInputs, closed_form, inputs_from_results

    curve = ((256, 0.05), (1024, 0.15), (16384, 1.65))
    inputs = GoodputInputs(peerstate_recovery_s=0.3, control_plane=curve, comm_init_ref_s=0.0)
    assert inputs.recovery_s(256) == pytest.approx(0.3)
    assert inputs.recovery_s(1024) == pytest.approx(0.4)
    assert inputs.recovery_s(8704) == pytest.approx(0.3 + (0.9 - 0.05))  # halfway between 1,024 and 16,384
    slope = 1.5 / (16384 - 1024)  # past the end: the last segment's
    assert inputs.recovery_s(32768) == pytest.approx(0.3 + (1.65 + slope * 16384 - 0.05))
    flat = GoodputInputs(peerstate_recovery_s=0.3, comm_init_ref_s=0.0)
    assert flat.recovery_s(32768) == 0.3
    assert closed_form(inputs, 32768)["peerstate"] < closed_form(flat, 32768)["peerstate"]
    (tmp_path / "scale.json").write_text(json.dumps({"rows": [{"ranks": r, "ours_s": s} for r, s in curve]}))
    assert inputs_from_results(tmp_path).control_plane == curve


def test_recovery_time_adds_the_modelled_communicator_initialisation():
    from peerstate.tools.goodput import GoodputInputs, closed_form, table

    # MegaScale's anchor (5 s at 2,048 GPUs), linear in N by default: 40 s at 16,384
    inputs = GoodputInputs(peerstate_recovery_s=0.3)
    assert inputs.comm_init_s(2048) == pytest.approx(5.0)
    assert inputs.comm_init_s(16384) == pytest.approx(40.0)
    assert inputs.recovery_s(16384) == pytest.approx(0.3 + 40.0)
    square_root = GoodputInputs(peerstate_recovery_s=0.3, comm_init_exponent=0.5)
    assert square_root.comm_init_s(8192) == pytest.approx(10.0)
    none = GoodputInputs(peerstate_recovery_s=0.3, comm_init_ref_s=0.0)
    assert closed_form(inputs, 16384)["peerstate"] < closed_form(none, 16384)["peerstate"]
    row = table(inputs, [16384])[0]
    assert row["comm_init_s"] == pytest.approx(40.0) and row["peerstate_recovery_s"] == pytest.approx(40.3)

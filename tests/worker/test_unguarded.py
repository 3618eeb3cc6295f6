"""Random draws between two guarded steps: found from the global generators' states,
said once, and not across a recovery (which restores the states)."""

import random

import numpy
import pytest

torch = pytest.importorskip("torch")

from peerstate.worker.unguarded import UnguardedDraws  # noqa: E402


@pytest.mark.parametrize("draw, generator", [(lambda: torch.rand(1), "torch"), (lambda: random.random(), "python"),
                                             (lambda: numpy.random.rand(), "numpy")])
def test_a_draw_between_two_guards_is_said_once_naming_its_generator(draw, generator):
    draws = UnguardedDraws()
    assert draws.cause(0, 1) is None  # nothing marked yet: the first guard
    draws.mark(0)
    assert draws.cause(0, 1) is None  # no draw since the step ended
    draws.mark(0)
    draw()
    cause = draws.cause(0, 2)
    assert cause.startswith(f"random numbers were drawn from {generator}'s global generator between the end of "
                            "step 1's guard and step 2's"), cause
    draws.mark(0)
    draw()
    assert draws.cause(0, 3) is None  # said once


def test_a_recovery_between_two_guards_is_no_draw():
    draws = UnguardedDraws()
    draws.mark(0)
    torch.manual_seed(5)  # the recovery's restore
    assert draws.cause(1, 4) is None

"""Job's options (``JobOptions``): a combination that cannot work is refused before
anything starts, with the option named; the data-parallel shares come from the
environment when the script does not give them."""

import pytest

from peerstate.errors import InvalidArgumentError
from peerstate.worker.options import DATA_PARALLEL_SHARES_VARIABLE, JobOptions


def test_fewer_versions_than_a_recovery_can_need_are_refused_by_the_job_itself():
    # The synced pipeline needs 2 slots (the version being copied and the one every rank
    # has landed; JobOptions's docstring says why), the eager one 3, the lazy one 4: 1
    # leaves nothing while a copy is under way. Job() refuses before it reads its
    # environment or connects anywhere, and says what 2, 3 and 4 cost.
    import peerstate

    with pytest.raises(InvalidArgumentError, match=r"versions >= 2 \(got 1, 1\).*2 copies each version beside the next forward"):
        peerstate.Job(versions=1)
    assert JobOptions(versions=2).versions == 2 and JobOptions(versions=3).versions == 3


@pytest.mark.parametrize("options, named", [
    (dict(snapshot_every=0), r"snapshot_every >= 1"),
    (dict(abort_timeout=0), r"abort_timeout must be positive"),
    (dict(abort_timeout=120.0, join_timeout=120.0), r"shorter than join_timeout.*got 120.0 and 120.0"),
    (dict(checkpoint_every=10), r"checkpoint_every needs a checkpoint_dir"),
    (dict(parity_group=2), r"parity_group=2 with k=1: a parity group has 3 members or more"),
    (dict(parity_group=4, k=2), r"parity_group=4 with k=2: .*it replaces the buddies"),
])
def test_a_combination_that_cannot_work_is_refused_with_the_option_named(options, named):
    with pytest.raises(InvalidArgumentError, match=named):
        JobOptions(**options)


def test_the_defaults_hold_and_a_checkpoint_every_with_its_folder_is_taken():
    assert JobOptions().versions == 4 and JobOptions().abort_timeout < JobOptions().join_timeout
    assert JobOptions(checkpoint_every=10, checkpoint_dir="/tmp/x").checkpoint_every == 10


def test_the_shares_come_from_the_environment_only_when_not_given(monkeypatch):
    monkeypatch.delenv(DATA_PARALLEL_SHARES_VARIABLE, raising=False)
    assert JobOptions().shares() is None
    monkeypatch.setenv(DATA_PARALLEL_SHARES_VARIABLE, "1")
    assert JobOptions().shares() == 1
    assert JobOptions(data_parallel_shares=2).shares() == 2

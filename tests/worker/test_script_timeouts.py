"""A script's process-group timeouts after Job(): kept to peerstate's bounds (gloo)."""

import datetime

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.worker.process_groups import ProcessGroups, Subgroup  # noqa: E402
from peerstate.worker.script_timeouts import claim_pg_timeouts, release_pg_timeouts  # noqa: E402


@pytest.fixture
def groups(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
    groups = ProcessGroups("gloo", collective_timeout=30.0)
    cut = []
    claim_pg_timeouts(groups, cut.append)
    try:
        yield kv, groups, cut
    finally:
        release_pg_timeouts()
        groups.destroy()


def trainer_sets(timeout, group=None):
    """What torchtitan's set_pg_timeouts calls: torch.distributed.set_timeout where torch
    has it (2.14), the private _set_pg_timeout (deprecated from 2.14) before."""
    (getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout)(timeout, group)


TRAINER_CALL = ("torch.distributed.set_timeout" if hasattr(dist, "set_timeout")
                else "torch.distributed.distributed_c10d._set_pg_timeout")


def waits(*process_groups):
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in process_groups]


def test_a_longer_timeout_is_kept_at_peerstates_a_shorter_one_lasts_through_reformations(groups):
    kv, groups, cut = groups
    declared = Subgroup([0], {})
    groups.add(declared, timeout=10)
    groups.form(kv, 0, rank=0, world_size=1, timeout=10)
    default = dist.distributed_c10d._get_default_group()
    assert waits(default, declared.group) == [30, 30]

    trainer_sets(datetime.timedelta(seconds=100))
    declared.group.set_timeout(datetime.timedelta(seconds=100))
    assert waits(default, declared.group) == [30, 30]
    [said] = cut  # once per process, naming the call, the group and what it was kept at
    assert f"{TRAINER_CALL}(100s) on process group '0' was kept at 30s" in said, said
    assert "Raise Job(abort_timeout=...)" in said

    trainer_sets(datetime.timedelta(seconds=5), declared.group)
    assert waits(default, declared.group) == [30, 5]
    groups.destroy()
    groups.form(kv, 1, rank=0, world_size=1, timeout=10)  # a recovery's re-formation
    default = dist.distributed_c10d._get_default_group()
    assert waits(default, declared.group) == [30, 5]
    groups.destroy()
    groups.collective_timeout = 60  # a regroup's plan doubled peerstate's own wait
    groups.form(kv, 2, rank=0, world_size=1, timeout=10)
    default = dist.distributed_c10d._get_default_group()
    assert waits(default, declared.group) == [60, 5]
    groups.abort(3)  # peerstate's own bound after an abort still applies
    assert waits(default, declared.group) == [1, 1]
    assert len(cut) == 1


def test_a_group_peerstate_did_not_form_gets_what_the_script_asks(groups):
    kv, groups, cut = groups
    groups.form(kv, 0, rank=0, world_size=1, timeout=10)
    own = dist.new_group([0])
    trainer_sets(datetime.timedelta(seconds=100), own)
    assert waits(own) == [100] and not cut
    release_pg_timeouts()
    trainer_sets(datetime.timedelta(seconds=100))  # released: torch's own again
    assert waits(dist.distributed_c10d._get_default_group()) == [100]
    own.set_timeout(datetime.timedelta(seconds=50))  # the method set back still binds its group (torch 2.14)
    assert waits(own) == [50]

"""Each private torch API peerstate uses (``peerstate.worker.torch_private``), checked
against the installed torch by what peerstate needs it to do: a torch release that
renames or changes one fails its test here, not a recovery in a user's job. One
process, a one-rank gloo group. Not run here: the NCCL branch of ``one_nccl_call``
(this torch has no NCCL backend; the GPU check runs the recovery path on NCCL)."""

import datetime

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from peerstate.worker import torch_private  # noqa: E402


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            torch_private.abort_all_groups()


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_group_names_is_torchs_live_registry_of_every_group(world):
    subgroup = dist.new_group([0])
    names = torch_private.group_names()
    assert set(names) == {dist.group.WORLD, subgroup}
    assert names[subgroup] == dist.distributed_c10d._get_process_group_name(subgroup)


def test_reset_group_naming_makes_the_next_groups_repeat_the_names_of_the_first(world):
    first = [torch_private.group_names()[dist.new_group([0])] for _ in range(2)]
    later = [torch_private.group_names()[dist.new_group([0])] for _ in range(2)]
    assert later != first  # torch counts on: a re-formed epoch would get other names
    torch_private.abort_all_groups()
    dist.distributed_c10d._world.group_count += 3  # as a rendezvous aborted part way leaves it
    torch_private.reset_group_naming()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert [torch_private.group_names()[dist.new_group([0])] for _ in range(2)] == first


def test_default_group_is_the_world(world):
    assert torch_private.default_group() is dist.group.WORLD


def test_is_member_tells_a_group_from_the_marker_new_group_gives_a_non_member(world):
    assert torch_private.is_member(dist.new_group([0]))
    assert not torch_private.is_member(dist.GroupMember.NON_GROUP_MEMBER)


def test_set_group_timeout_sets_the_collectives_timeout(world):
    group = dist.new_group([0])
    torch_private.set_group_timeout(group, datetime.timedelta(seconds=12))
    assert _timeout(group) == datetime.timedelta(seconds=12)
    assert _timeout(dist.group.WORLD) != datetime.timedelta(seconds=12)


def test_abort_all_groups_leaves_no_group(world):
    dist.new_group([0])
    torch_private.abort_all_groups()
    assert not dist.is_initialized() and not torch_private.group_names()


def test_one_nccl_call_yields_every_group_newest_first_without_an_nccl_backend(world):
    subgroup = dist.new_group([0])
    with torch_private.one_nccl_call() as groups:
        assert groups == [subgroup, dist.group.WORLD]


def test_groups_created_under_a_timeout_get_it(world):
    with torch_private.groups_created_under(7):
        inside = dist.new_group([0])
    after = dist.new_group([0])
    assert _timeout(inside) == datetime.timedelta(seconds=7)
    assert _timeout(after) != datetime.timedelta(seconds=7)


def test_a_meshs_group_names_are_its_groups_names_and_its_registry_resolves_them(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    names = torch_private.mesh_group_names(mesh)
    assert names == [torch_private.group_names()[mesh.get_group(dim)] for dim in ("a", "b")]
    fresh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    torch_private.share_mesh_groups(mesh, fresh)
    assert {name: mesh._pg_registry[name] for name in torch_private.mesh_group_names(fresh)} == \
        {name: fresh._pg_registry[name] for name in torch_private.mesh_group_names(fresh)}


def test_ddp_takes_its_bucket_layout_from_the_assignment_given(world):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    calls = []

    def one_bucket_each(params, limits, *args, **kwargs):
        calls.append(len(params))
        return [[i] for i in reversed(range(len(params)))], [limits[0]] * len(params)

    with torch_private.ddp_bucket_assignment(one_bucket_each):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    assert calls == [4]
    assert dist._compute_bucket_assignment_by_size is not one_bucket_each  # restored
    ddp(torch.ones(2, 4)).sum().backward()  # the reducer works with the layout given
    assert all(p.grad is not None for p in model.parameters())


def test_fsdp_param_group_and_whether_the_root_ran(world):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    assert torch_private.fsdp_param_group(model[0]) is not None
    assert torch_private.fsdp_param_group(model[1]) is None  # not an FSDP module
    assert not torch_private.fsdp_ran(model)
    model(torch.ones(2, 4)).sum().backward()
    assert torch_private.fsdp_ran(model)


def test_sequence_number_counts_a_groups_collectives(world):
    group = dist.new_group([0])
    before = torch_private.sequence_number(group)
    dist.all_reduce(torch.ones(1), group=group)
    assert torch_private.sequence_number(group) == before + 1


def test_pipeline_stages_of_a_single_and_a_multi_stage_schedule(world):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    def stage(index, count):
        return PipelineStage(torch.nn.Linear(4, 4), index, count, torch.device("cpu"))

    single = stage(0, 1)
    assert torch_private.pipeline_stages(ScheduleGPipe(single, n_microbatches=2)) == [single]
    both = [stage(0, 2), stage(1, 2)]
    assert torch_private.pipeline_stages(ScheduleInterleaved1F1B(both, n_microbatches=2)) == both


def test_an_untested_torch_is_said(monkeypatch):
    for tested in ("2.13.0+cpu", "2.14.1"):
        monkeypatch.setattr(torch, "__version__", tested)
        assert torch_private.untested_torch() is None
    monkeypatch.setattr(torch, "__version__", "9.1.0")
    assert "torch 9.1.0 is not a release peerstate is tested with (2.13, 2.14)" in torch_private.untested_torch()

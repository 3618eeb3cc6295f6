"""Process groups over real gloo groups: declared subgroups formed with the epoch's
group, gone with it, and formed again with the next one; late aborts; the
collective timeout."""

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from peerstate import InvalidArgumentError  # noqa: E402
from peerstate.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.process_groups import ProcessGroups, Subgroup  # noqa: E402


@pytest.fixture
def groups(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
    groups = ProcessGroups("gloo")
    yield kv, groups
    groups.destroy()


def test_a_subgroup_is_formed_with_every_epoch(groups):
    kv, groups = groups
    declared = Subgroup([0], {})
    groups.add(declared, timeout=10)  # before the first epoch, as a spare declares it
    with pytest.raises(InvalidArgumentError, match=r"subgroup over ranks \[0\] is not formed"):
        declared.group
    for epoch in (0, 1):
        groups.form(kv.torch_store, epoch, rank=0, world_size=1, timeout=10)
        total = torch.tensor([3])
        dist.all_reduce(total, group=declared.group)
        assert int(total) == 3
        groups.destroy()
        with pytest.raises(InvalidArgumentError, match="not formed"):
            declared.group


def test_a_subgroup_declared_in_a_formed_epoch_is_formed_at_once(groups):
    kv, groups = groups
    groups.form(kv.torch_store, 0, rank=0, world_size=1, timeout=10)
    declared = Subgroup([0], {})
    groups.add(declared, timeout=10)
    assert declared.group is not None and dist.get_world_size(declared.group) == 1


def _peer(kv, epoch, body):
    """A second process, rank 1 of a 2-rank gloo group of ``epoch``, that then runs ``body``."""
    import subprocess
    import sys

    script = f"""
import sys, time, torch, torch.distributed as dist
from peerstate.kvstore import TorchKeyValueStore
from peerstate.process_groups import ProcessGroups
kv = TorchKeyValueStore("127.0.0.1", int(sys.argv[1]), timeout=30)
groups = ProcessGroups("gloo")
groups.form(kv.torch_store, {epoch}, rank=1, world_size=2, timeout=30)
{body}
"""
    return subprocess.Popen([sys.executable, "-c", script, str(kv.port)], stdout=subprocess.PIPE, text=True)


def test_an_abort_that_comes_after_its_epoch_formed_leaves_the_group_alone(groups):
    # The watcher thread of a worker can see a plan after the training loop has
    # already joined its epoch; the late abort must not shut down the new group.
    kv, groups = groups
    peer = _peer(kv, 1, """
for _ in range(2):
    total = torch.tensor([2])
    dist.all_reduce(total)
    print(int(total), flush=True)
groups.destroy()""")
    try:
        groups.form(kv.torch_store, 1, rank=0, world_size=2, timeout=30)
        groups.abort(1)  # late: epoch 1's group is the one formed
        for _ in range(2):
            total = torch.tensor([1])
            dist.all_reduce(total)
            assert int(total) == 3
        assert peer.communicate(timeout=60)[0].split() == ["3", "3"]
        groups.abort(2)  # a newer epoch's abort still goes through
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.tensor([1]))
    finally:
        peer.kill()
        peer.wait()


def test_gloo_collectives_time_out_after_the_collective_timeout(groups):
    # A gloo send that was being written when its peer died is woken by no abort
    # (see process_groups): the collective timeout is what ends it, long before
    # the rendezvous timeout (30 s here) and the Job's abort deadline.
    import time

    kv, _ = groups
    timed = ProcessGroups("gloo", collective_timeout=2.0)
    peer = _peer(kv, 0, """
print("formed", flush=True)
time.sleep(60)  # never enters the collective""")
    try:
        timed.form(kv.torch_store, 0, rank=0, world_size=2, timeout=30)
        assert peer.stdout.readline().strip() == "formed"
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            dist.all_reduce(torch.ones(4))
        assert time.monotonic() - started < 15
    finally:
        timed.destroy()
        peer.kill()
        peer.wait()

"""Parity groups (``Job(parity_group=4)``) end to end: real agents on four simulated
nodes, real workers (FSDP2 over gloo, each rank's shard its own), real SIGKILL. A lost
rank's shard is rebuilt from its group's parity and the survivors' own snapshots, bit
for bit; two losses in the group fall back to the disk checkpoint, naming the group."""

import mmap
import re
import signal

import pytest

torch = pytest.importorskip("torch")

from helpers.jobs import FAST, STEPS, Job  # noqa: E402

FOUR_NODES = [(1, 1), (1, 0), (1, 0), (1, 0)]  # one rank per node (one group of 4), a spare on node 0
MODEL = ["--fsdp"]
PARITY = [*MODEL, "--parity-group", "4"]


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    """Each rank's final shards in the fault-free FSDP2 run (4 ranks on one node)."""
    job = Job(tmp_path_factory.mktemp("fsdp-reference"), [(4, 0)], steps=STEPS, script_args=MODEL)
    try:
        assert job.wait() == [0], job.describe()
        return {rank: torch.load(f"{job.out}.rank{rank}") for rank in range(4)}
    finally:
        job.close()


def assert_shards_bitwise(job, reference):
    for rank in range(4):
        final = torch.load(f"{job.out}.rank{rank}")
        different = [k for k in reference[rank] if not torch.equal(final[k], reference[rank][k])]
        assert not different, f"rank {rank}: shards {different} differ from the fault-free run"


@pytest.mark.parametrize("versions", [[], ["--versions", "2"]], ids=["lazy", "synced"])
def test_a_killed_rank_is_rebuilt_from_its_group_bitwise_holding_a_third_of_a_copy(run, fsdp_reference, versions):
    job = run(nodes=FOUR_NODES, script_args=PARITY + versions)
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    assert job.wait() == [0, 0, 0, 0], job.describe()
    assert_shards_bitwise(job, fsdp_reference)
    [recovery] = job.events("recovery")
    assert recovery["failed"] == [2]
    # What each rank holds for the others: two parity blocks of a third of its shard, to a
    # whole chunk (4 MiB: this shard is one chunk, so a block is the whole of it; the
    # figures at scale are bench/redundancy.py's), where a buddy holds two regions of a copy.
    # Own versions: 4 (lazy, the default) or 2 (synced: 2 + 2/3 of a shard in all, at scale).
    kept = int(versions[1]) if versions else 4
    for m in {m["rank"]: m for m in job.events("memory")}.values():
        per = m["snapshot_per_version"]
        assert 0 < m["replicas_reserved"] <= 2 * (per // 3 + (4 << 20)), m
        assert m["snapshots_held"] == kept * (-(-per // mmap.PAGESIZE) * mmap.PAGESIZE), m
        assert m["redundancy"] == "parity", m
    summary = job.agent_logs[1].read_text()
    assert "its parity group's blocks" in summary and "buddies" not in summary, summary


def test_a_whole_node_lost_is_rebuilt_from_the_other_nodes_bitwise(run, fsdp_reference):
    # With 2 own versions (the synced pipeline): the fewest a node loss under load can
    # find a common step with (JobOptions.versions).
    job = run(nodes=FOUR_NODES, script_args=PARITY + ["--versions", "2"])
    job.wait_for(lambda: job.spare_pids(), "the spare")
    job.wait_for_step(2, 10)
    job.kill_node(1)
    codes = job.wait()
    assert codes[0] == codes[2] == codes[3] == 0, job.describe()
    assert_shards_bitwise(job, fsdp_reference)
    [plan] = job.events("plan")
    assert plan["failed"] == [1] and "node 1 lost" in plan["reason"]


def test_two_losses_in_the_group_fall_back_to_the_disk_checkpoint_naming_it(run, fsdp_reference, tmp_path):
    checkpoints = ["--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "5"]
    job = run(nodes=[(1, 1), (1, 0), (1, 0), (1, 1)], script_args=PARITY, agent_args=FAST + checkpoints)
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(1, 8)
    pids = [job.pid_of(rank) for rank in (1, 2)]  # found first, then killed back to back
    for rank, pid in zip((1, 2), pids):
        job.signal_process(pid, signal.SIGKILL, f"rank {rank}")
    assert job.wait() == [0, 0, 0, 0], job.describe()
    assert_shards_bitwise(job, fsdp_reference)
    fallbacks = job.events("checkpoint_fallback")
    assert fallbacks, job.describe()
    assert re.search(r"parity group \[0, 1, 2, 3\] lost ranks 1, 2", fallbacks[0]["message"]), fallbacks

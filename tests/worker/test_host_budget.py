"""A rank's share of its node's memory (worker/host_budget.py): where the node's
limit is read (a cgroup's, the machine's, or PEERSTATE_HOST_MEMORY), and what is
refused before it is allocated, with the job stopped saying what to do."""

import pytest

from peerstate.control import keys
from peerstate.control.coordinator import Coordinator
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.errors import InvalidArgumentError
from peerstate.worker.host_budget import HostMemoryBudget, cgroup_limits, node_memory, parse_bytes, size

GIB = 1 << 30


@pytest.mark.parametrize("text, expected", [("68719476736", 64 * GIB), ("64G", 64 * GIB), ("64GiB", 64 * GIB),
                                            ("1.5t", 1536 * GIB), ("512M", 512 << 20), ("1K", 1024)])
def test_sizes_read_as_a_person_writes_them(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "G"])
def test_a_size_that_is_not_one_names_the_variable(text):
    with pytest.raises(InvalidArgumentError, match="PEERSTATE_HOST_MEMORY=.* is not a size"):
        parse_bytes(text)


def test_the_limits_of_a_v2_cgroup_and_its_ancestors_and_of_a_v1_memory_cgroup_are_read(tmp_path):
    root = tmp_path / "cgroup"
    (root / "job.slice" / "worker").mkdir(parents=True)
    (root / "job.slice" / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "job.slice" / "worker" / "memory.max").write_text("max\n")  # no limit of its own
    (root / "memory" / "batch").mkdir(parents=True)
    (root / "memory" / "batch" / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("12:cpu,cpuacct:/batch\n11:memory:/batch\n0::/job.slice/worker\n")
    limits = cgroup_limits(proc, root)
    assert sorted(limits.values()) == [4 * GIB, 8 * GIB]
    assert any(path.endswith("job.slice/memory.max") for path in limits)
    assert cgroup_limits(tmp_path / "absent", root) == {}


def test_the_node_is_as_large_as_the_variable_says_else_its_smallest_limit():
    assert node_memory({"PEERSTATE_HOST_MEMORY": "3G"}) == (3 * GIB, "PEERSTATE_HOST_MEMORY")
    nbytes, source = node_memory({})
    assert nbytes > 0 and (source == "physical memory" or source.endswith(("memory.max", "memory.limit_in_bytes")))


def test_what_fits_the_share_passes_and_what_does_not_stops_the_job_with_what_to_do():
    kv = InMemoryKeyValueStore()
    budget = HostMemoryBudget(16 * GIB, "physical memory", 4, Coordinator(kv).fail_job)
    assert budget.share == 4 * GIB
    budget.own(3, 3 * GIB, 5)
    budget.replicas(3, {2: GIB // 4})  # 3 GiB and 2 x 0.25 GiB: within 4 GiB
    assert kv.get(keys.JOB_FAILED) is None
    with pytest.raises(InvalidArgumentError) as refused:
        budget.replicas(3, {2: GIB // 2, 1: GIB // 2})  # 3 GiB and 2 GiB
    message = str(refused.value)
    assert message.startswith("rank 3 cannot hold its state for recoveries in this node's memory: 5 versions of its "
                              "own state take 3.00 GiB and two regions of each replica it holds for ranks [1, 2] "
                              "take 2.00 GiB, over its share of 4.00 GiB (16.00 GiB from the node's physical memory, "
                              "for 4 ranks)"), message
    assert ("(FSDP, more data-parallel shares), keep fewer versions (Job(versions=5) now; 2 at least, at the cost "
            "of a copy and a push the step waits for), or") in message
    assert kv.get(keys.JOB_FAILED).decode() == message  # the job stops: every rank would refuse the same


def test_a_replacement_refused_for_its_replicas_before_its_own_versions_names_only_the_replicas():
    budget = HostMemoryBudget(4 * GIB, "physical memory", 2, Coordinator(InMemoryKeyValueStore()).fail_job)
    with pytest.raises(InvalidArgumentError, match=r": two regions of each replica it holds for ranks \[0\] take "
                                                   r"4\.00 GiB, over its share of 2\.00 GiB "):
        budget.replicas(1, {0: 2 * GIB})


def test_the_first_reason_recorded_is_the_one_raised():
    kv = InMemoryKeyValueStore()
    coordinator = Coordinator(kv)
    coordinator.fail_job("rank 0 refused first")
    with pytest.raises(InvalidArgumentError, match="^rank 0 refused first$"):
        HostMemoryBudget(GIB, "physical memory", 2, coordinator.fail_job).own(1, GIB, 4)


def test_at_the_fewest_versions_fewer_are_not_offered():
    kv = InMemoryKeyValueStore()
    with pytest.raises(InvalidArgumentError) as refused:
        HostMemoryBudget(GIB, "physical memory", 2, Coordinator(kv).fail_job).own(1, GIB, 2)
    assert "fewer versions" not in str(refused.value)
    assert "(FSDP, more data-parallel shares), or, if this node has more memory" in str(refused.value)
    with pytest.raises(InvalidArgumentError) as refused:  # the default, 4: the synced pipeline's 2 are offered
        HostMemoryBudget(GIB, "physical memory", 2, Coordinator(InMemoryKeyValueStore()).fail_job).own(1, GIB, 4)
    assert "keep fewer versions (Job(versions=4) now; 2 at least" in str(refused.value)


def test_sizes_are_said_in_the_unit_that_reads():
    assert (size(1.19 * GIB), size(512 << 20), size(64 << 10)) == ("1.19 GiB", "512.0 MiB", "64 KiB")

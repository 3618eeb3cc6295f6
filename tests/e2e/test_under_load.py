"""Recovery on a loaded node: every core busy, a worker throttled by its CPU quota, a
worker frozen by SIGSTOP or by its cgroup, a rank that raises. Nothing healthy or
exiting is taken for frozen; what is frozen is found by the freeze bound (the hang
bound here is a minute, so nothing else could find it); every run ends bitwise."""

import contextlib
import signal

import pytest

torch = pytest.importorskip("torch")

from helpers.jobs import assert_bitwise  # noqa: E402
from helpers.load import busy_cores, cpu_quota, freezer  # noqa: E402
from peerstate.launcher import kernel_state  # noqa: E402

pytestmark = pytest.mark.skipif(not kernel_state.AVAILABLE, reason="needs Linux /proc")

# Only the freeze bound (0.5 s) can find a frozen worker here; a stalled heartbeat takes a minute.
FREEZE_ONLY = ["--lease-timeout", "1.5", "--hang-timeout", "60", "--spare-timeout", "30", "--join-timeout", "60"]


def exits(job):
    return [(e["rank"], e["how"]) for e in job.events("process_exited") if e["code"] != 0 and e["rank"] is not None]


def test_a_rank_that_raises_on_a_loaded_node_is_reported_as_exited(run, reference):
    with busy_cores(1):
        job = run(script_args=["--raise-at", "1:8", "--step-function"])
        assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [failure] = job.events("failure_detected")
    assert "rank 1 (n0.1) exited with code 1" == failure["reason"], failure
    assert exits(job) == [(1, "exited with code 1")], job.describe()
    assert not job.events("hung_worker_frozen"), job.describe()


def test_a_starved_and_throttled_job_trains_through_without_a_failure(run, reference):
    # Two burners a core, and rank 1 held to 0.05 s of CPU a second: its liveness count stands
    # still for most of each second, nearly twice the freeze bound. (At 0.1 s a second, once a
    # replication round cost fewer threads, a step's CPU could fit under the quota: nothing was
    # throttled, and the test's premise failed.)
    with busy_cores(4), cpu_quota(0.05, 1.0) as group:
        job = run(agent_args=FREEZE_ONLY)
        job.wait_for_step(1, 2)
        group.add(job.pid_of(1))
        assert job.wait(timeout=300) == [0, 0], job.describe()
        throttled = dict(line.split() for line in group.read("cpu.stat").splitlines())
    assert_bitwise(job, reference)
    assert int(throttled["nr_throttled"]) > 0, throttled
    assert not job.events("failure_detected") and not exits(job), job.describe()


@pytest.mark.parametrize("how", ["SIGSTOP", "cgroup"])
def test_a_frozen_worker_on_a_loaded_node_is_found_by_the_freeze_bound(run, reference, how):
    with busy_cores(1), (freezer(2) if how == "cgroup" else contextlib.nullcontext()) as group:
        job = run(agent_args=FREEZE_ONLY)
        job.wait_for(lambda: job.spare_pids(), "the spare")
        job.wait_for_step(3, 4)
        if group is None:
            job.kill_rank(3, signal.SIGSTOP)
            frozen = "stopped by a signal, state T"
        else:
            group.add(job.pid_of(3))
            group.freeze()
            frozen = f"frozen by its cgroup {group.path}"
        assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [failure] = job.events("failure_detected")
    assert failure["reason"].startswith(f"rank 3 (n1.1) hung: frozen ({frozen}"), failure


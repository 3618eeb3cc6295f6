"""Jobs whose control plane lives in a real etcd cluster (``--store etcd://``): node
0 is a node like any other, the store's own leader can die mid-job, and a store
gone past its bound stops every agent cleanly. Real agents, workers, signals
and etcd processes on 127.0.0.1."""

import re
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from helpers.etcd import CuttableLink, EtcdCluster, make_tls  # noqa: E402
from helpers.jobs import FAST, STEPS, Job, assert_bitwise  # noqa: E402

@pytest.fixture
def etcd(tmp_path, request):
    cluster = EtcdCluster(tmp_path, members=getattr(request, "param", 1))
    yield cluster
    cluster.close()


@pytest.fixture
def run(tmp_path, etcd):
    jobs = []

    def start(nodes, agent_args=(), store=None, **kwargs):
        job = Job(tmp_path / f"job{len(jobs)}", nodes, steps=kwargs.pop("steps", STEPS), store=store or etcd.url,
                  agent_args=[*FAST, "--job-id", f"{tmp_path.name}-{len(jobs)}", *agent_args], **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()


@pytest.mark.parametrize("etcd", [3], indirect=True)
def test_the_etcd_leader_and_then_node_0_lost_and_the_job_ends_bitwise(run, etcd, reference):
    # With a TCPStore, node 0 hosts the store and its loss stops the job.
    job = run([(2, 0), (2, 2)], agent_args=["--store-timeout", "15"])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(0, 5)
    etcd.kill(etcd.leader())
    job.wait_for_step(0, 12)  # training goes on, on the two members left
    job.kill_node(0)
    codes = job.wait()
    assert codes[0] == -signal.SIGKILL and codes[1] == 0, job.describe()
    assert_bitwise(job, reference)  # the reference ran on a TCPStore: the store must not matter
    [plan] = job.events("plan")
    assert sorted(plan["failed"]) == [0, 1] and "node 0 lost" in plan["reason"]


def test_a_store_gone_past_its_bound_stops_every_agent_and_keeps_the_checkpoints(run, tmp_path):
    # Over TLS with client certificates, as a production etcd is: the workers open the
    # store from the address their agent hands them, certificate files included.
    (tmp_path / "tls").mkdir()
    tls = make_tls(tmp_path / "tls")
    etcd = EtcdCluster(tmp_path / "tls", tls=tls)
    checkpoints = tmp_path / "checkpoints"
    try:
        job = run([(2, 1), (2, 0)], steps=10_000, store=etcd.url,
                  agent_args=["--store-timeout", "2", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3",
                              "--store-cacert", tls.ca, "--store-cert", tls.client_cert, "--store-key", tls.client_key])
        job.wait_for_step(3, 7)
        saved = sorted(p.relative_to(checkpoints) for p in checkpoints.rglob("*") if p.is_file())
    finally:
        etcd.close()  # the store goes: every member killed (here, or after a failure above)
    gone = time.monotonic()
    codes = job.wait(timeout=60)
    stopped = time.monotonic() - gone
    assert codes == [1, 1], job.describe()
    assert stopped < 2 + 15, f"the agents stopped {stopped:.0f}s after the store, past its 2 s bound and margin"
    for log in job.agent_logs:
        summary = log.read_text()
        assert "cannot go on" in summary and f"{etcd.endpoints[0]} (TLS)" in summary and "for 2s" in summary, summary
        assert f"checkpoints in {checkpoints} are kept" in summary, summary
    # nothing of the job is left, and what was checkpointed is still there
    assert not job.leftover_processes()
    assert saved and all((checkpoints / p).is_file() for p in saved)
    assert not job.events("plan")  # no agent planned a recovery out of a lost store


def test_a_node_cut_off_from_the_store_alone_gives_its_ranks_to_spares_and_stops(run, etcd, reference):
    # No split brain: the others declare node 1 lost and its ranks go to node 0's spares;
    # node 1's own workers train no step past that (every epoch forms through the store),
    # and its agent, which cannot even learn it was declared lost, stops at the bound.
    link = CuttableLink(etcd.endpoints[0])
    job = run([(2, 2), (2, 0)], store=[etcd.url, f"etcd://{link.address}"], agent_args=["--store-timeout", "4"])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(2, 10)
    link.cut()
    codes = job.wait()
    assert codes == [0, 1], job.describe()
    assert_bitwise(job, reference)
    [plan] = job.events("plan")
    assert sorted(plan["failed"]) == [2, 3] and "node 1 lost" in plan["reason"]
    summary = job.agent_logs[1].read_text()
    assert "did not answer for 4s" in summary and "Node 1 stops its workers" in summary, summary
    # Until the others declared node 1 lost, all four trained on together (the store is not in a step);
    # then rank 0's step was interrupted and it rolled back. Node 1's workers finished no step after it.
    [interrupted] = [e["step"] for e in job.events("step_interrupted") if e["source"] == "n0.0"]
    for rank in (2, 3):
        old = _steps(job, f"n1.{rank - 2}", rank)
        assert old and max(old) <= interrupted, (rank, old[-3:], interrupted)
        assert _steps(job, plan["replaced"][str(rank)], rank)[-1] == STEPS - 1


def _steps(job, worker, rank):
    return [int(s) for s in re.findall(rf"^rank {rank} step (\d+)", (job.logs / f"{worker}.log").read_text(), re.M)]

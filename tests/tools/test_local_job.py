"""LocalJob's simulated nodes: agents forked from one starter, each forking its own
fork server, each still its own node (its own session, killed whole)."""

import os

import pytest

pytest.importorskip("torch")

from helpers.jobs import FAST, Job  # noqa: E402
from peerstate.tools.local import alive  # noqa: E402


def parent_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])


@pytest.mark.e2e
def test_the_agents_of_a_local_job_share_one_starter_and_each_forks_its_own_server(tmp_path):
    job = Job(tmp_path, [(2, 0), (2, 0)], agent_args=FAST, steps=2000)
    try:
        for rank in range(4):
            job.wait_for_step(rank, 1)
        starter = job._starter._popen.pid
        agents = [agent.pid for agent in job.agents]
        assert [parent_of(pid) for pid in agents] == [starter, starter]
        assert [os.getpgid(pid) for pid in agents] == agents  # each node its own process group
        servers = [parent_of(job.pid_of(rank)) for rank in range(4)]
        assert [parent_of(server) for server in servers] == [agents[0]] * 2 + [agents[1]] * 2
        job.kill_node(1)  # node 1 whole: its agent, its server, its workers; node 0 is untouched
        job.wait_for(lambda: not any(alive(pid) for pid in [agents[1], servers[2]]), "node 1 to die", 30)
        assert alive(agents[0]) and alive(servers[0]) and alive(starter)
    finally:
        job.close()
    assert not alive(starter) and job.leftover_processes() == []

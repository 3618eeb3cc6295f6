import pytest

from helpers.jobs import FAST, STEPS, Job

TWO_NODES = [(2, 1), (2, 0)]  # 4 workers on 2 simulated nodes + 1 spare


@pytest.fixture
def run(tmp_path):
    """Start jobs (``Job``'s arguments; 2 nodes and the e2e agent flags by default),
    every one closed after the test."""
    jobs = []

    def start(nodes=TWO_NODES, **kwargs):
        kwargs.setdefault("agent_args", FAST)
        job = Job(tmp_path / f"job{len(jobs)}", nodes, steps=kwargs.pop("steps", STEPS), **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final parameters of the fault-free run of the recovery tests' job (4 ranks on one
    node, a TCPStore): what every faulty run must end with. Once per module that asks."""
    torch = pytest.importorskip("torch")
    job = Job(tmp_path_factory.mktemp("reference"), [(4, 0)], steps=STEPS)
    try:
        assert job.wait() == [0], job.describe()
        return torch.load(job.out)
    finally:
        job.close()

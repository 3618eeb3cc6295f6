import pytest

from helpers.jobs import STEPS, Job


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

"""torchtitan's own Trainer (llama3 debug model, from PyPI) under
peerstate.integrations.torchtitan, with a kill -9 of one rank on CPU/gloo: every
rank's model and optimizer shards and train state end bitwise equal to the
fault-free run's. Skipped where torchtitan is not installed (it is in the
``torchtitan`` extra the README's test command installs)."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")
pytest.importorskip("tokenizers")

from helpers.jobs import FAST, Job  # noqa: E402
from helpers.torchtitan_assets import make_assets  # noqa: E402

HARNESS = Path(__file__).resolve().parents[1] / "helpers" / "torchtitan_job.py"
STEPS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("torchtitan_assets"))


def run(tmp_path, assets, layout, kill=None):
    out = tmp_path / "out"
    out.mkdir(parents=True)
    job = Job(tmp_path, [(2, 1), (2, 0)], steps=STEPS, agent_args=FAST, script=HARNESS, out=out,
              script_args=["--layout", layout, "--assets", str(assets)])
    try:
        if kill is not None:
            job.wait_for_step(kill, 4, 180)
            job.kill_rank(kill)
        assert job.wait() == [0, 0], job.describe()
        assert [e["failed"] for e in job.events("recovery")] == ([[kill]] if kill is not None else []), \
            job.describe()
        return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(4)}
    finally:
        job.close()


@pytest.mark.parametrize("layout, kill", [("hsdp", 2), ("fsdp_tp", 1)])
def test_torchtitans_trainer_recovers_a_killed_rank_bitwise(tmp_path, assets, layout, kill):
    reference = run(tmp_path / "reference", assets, layout)
    final = run(tmp_path / "killed", assets, layout, kill=kill)
    for rank in range(4):
        assert reference[rank].keys() == final[rank].keys()
        different = [key for key in reference[rank] if not torch.equal(final[rank][key], reference[rank][key])]
        assert not different, f"{layout}: rank {rank}'s {different} differ from the fault-free run"

"""torchtitan's own Trainer (llama3 debug model, from PyPI) under
peerstate.integrations.torchtitan, with a kill -9 of one rank on CPU/gloo: every
rank's model and optimizer shards and train state end bitwise equal to the
fault-free run's. Skipped where torchtitan is not installed (it is in the
``torchtitan`` extra the README's test command installs)."""

import re
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


VALIDATED = re.compile(r"validate step:\s*(\d+)\D.*?loss:\s*(-?[\d.]+)")


def run(tmp_path, assets, layout, kill=None, validate_every=0):
    """Every rank's final state, and the validation losses logged, step -> {loss}."""
    out = tmp_path / "out"
    out.mkdir(parents=True)
    job = Job(tmp_path, [(2, 1), (2, 0)], steps=STEPS, agent_args=FAST, script=HARNESS, out=out,
              script_args=["--layout", layout, "--assets", str(assets), "--validate-every", str(validate_every)])
    try:
        if kill is not None:
            job.wait_for_step(kill, 4, 180)
            job.kill_rank(kill)
        assert job.wait() == [0, 0], job.describe()
        assert [e["failed"] for e in job.events("recovery")] == ([[kill]] if kill is not None else []), \
            job.describe()
        validated = {}
        for step, loss in VALIDATED.findall(job.text()):
            validated.setdefault(int(step), set()).add(loss)
        return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(4)}, validated
    finally:
        job.close()


# The pipeline also validates every 4 steps (inside the guard, through the schedule built
# again after the recovery): the same losses as the fault-free run's at every step.
@pytest.mark.parametrize("layout, kill, validate_every", [
    ("hsdp", 2, 0), ("fsdp_tp", 1, 0), ("pp_fsdp", 3, 4)])
def test_torchtitans_trainer_recovers_a_killed_rank_bitwise(tmp_path, assets, layout, kill, validate_every):
    reference, validated = run(tmp_path / "reference", assets, layout, validate_every=validate_every)
    final, validated_after_kill = run(tmp_path / "killed", assets, layout, kill=kill, validate_every=validate_every)
    if validate_every:
        assert sorted(validated) == [1, 4, 8, 12] and validated_after_kill == validated, (validated, validated_after_kill)
    for rank in range(4):
        assert reference[rank].keys() == final[rank].keys()
        different = [key for key in reference[rank] if not torch.equal(final[rank][key], reference[rank][key])]
        assert not different, f"{layout}: rank {rank}'s {different} differ from the fault-free run"

"""torchtitan's own Trainer (llama3 debug model, from PyPI) under
peerstate.integrations.torchtitan, with a kill -9 of one rank on CPU/gloo: every
rank's model and optimizer shards and train state end bitwise equal to the
fault-free run's. Skipped where torchtitan is not installed (it is in the
``torchtitan`` extra the README's test command installs)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")
pytest.importorskip("tokenizers")

from helpers.jobs import FAST, Job  # noqa: E402
from helpers.torchtitan_assets import make_assets  # noqa: E402

from peerstate.launcher.fork_server import DEFAULT_PRELOAD  # noqa: E402

HARNESS = Path(__file__).resolve().parents[1] / "helpers" / "torchtitan_job.py"
STEPS = 8  # a kill after step 3: the recovery, then 4 steps compared bit for bit
KILL_AFTER = 3
# torchtitan imported, and shimmed for the CPU, once per node by its fork server instead of
# once per worker (the harness's folder on PYTHONPATH): ~6 CPU-seconds a worker.
PRELOAD = ["--preload", ",".join([*DEFAULT_PRELOAD, "torchtitan_cpu"])]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("torchtitan_assets"))


VALIDATED = re.compile(r"validate step:\s*(\d+)\D.*?loss:\s*(-?[\d.]+)")


def run(tmp_path, assets, layout, kill=None, validate_every=0, preload=False):
    """Every rank's final state, and the validation losses logged, step -> {loss}; with
    ``preload``, the fork servers import torchtitan (else the default preload: each worker does)."""
    out = tmp_path / "out"
    out.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as env:  # the agents take the environment as they start
        if preload:
            paths = [str(HARNESS.parent), os.environ.get("PYTHONPATH")]
            env.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
        job = Job(tmp_path, [(2, 1), (2, 0)], steps=STEPS, agent_args=[*FAST, *(PRELOAD if preload else [])],
                  script=HARNESS, out=out,
                  script_args=["--layout", layout, "--assets", str(assets), "--validate-every", str(validate_every)])
    try:
        if kill is not None:
            job.wait_for_step(kill, KILL_AFTER, 180)
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
# again after the recovery): the same losses as the fault-free run's at every step. HSDP runs
# with the default preload, the others with torchtitan preloaded (as --preload's help advises).
@pytest.mark.parametrize("layout, kill, validate_every, preload", [
    ("hsdp", 2, 0, False), ("fsdp_tp", 1, 0, True), ("pp_fsdp", 3, 4, True)])
def test_torchtitans_trainer_recovers_a_killed_rank_bitwise(tmp_path, assets, layout, kill, validate_every, preload):
    reference, validated = run(tmp_path / "reference", assets, layout, validate_every=validate_every,
                               preload=preload)
    final, validated_after_kill = run(tmp_path / "killed", assets, layout, kill=kill, validate_every=validate_every,
                                      preload=preload)
    if validate_every:
        assert sorted(validated) == [1, 4, 8], validated
        assert validated_after_kill == validated, (validated, validated_after_kill)
    for rank in range(4):
        assert reference[rank].keys() == final[rank].keys()
        different = [key for key in reference[rank] if not torch.equal(final[rank][key], reference[rank][key])]
        assert not different, f"{layout}: rank {rank}'s {different} differ from the fault-free run"


def test_run_parses_the_workers_command_line_not_the_one_torchtitan_was_imported_under():
    # A fork server imports torchtitan under its own command line (--preload); a worker forked
    # from it has its own. torchtitan's main parses with ConfigManager().parse_args(), as the
    # probe put in its place here does.
    probe = ("import sys; sys.argv = ['server', '--training.steps', '3']\n"
             "import peerstate.integrations.torchtitan as titan\n"
             "from torchtitan.config import ConfigManager\n"
             "sys.argv = ['worker', '--training.steps', '5']\n"
             "print('bound', ConfigManager().parse_args().training.steps)\n"
             "titan.main = lambda trainer: print('run', ConfigManager().parse_args().training.steps)\n"
             "titan.run()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # torchtitan's own binding is the server's command line (what run() mends), run()'s the worker's
    assert re.findall(r"^(bound|run) (\d+)$", done.stdout, re.M) == [("bound", "3"), ("run", "5")], done.stdout

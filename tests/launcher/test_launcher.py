"""`peerstate run` refuses bad configurations with a clear error, and nothing hangs."""

import os
import re
import secrets
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # several real processes per test: left out of `-m "not e2e"`

pytest.importorskip("torch")

from helpers.jobs import Job  # noqa: E402

FAST = ["--join-timeout", "20", "--lease-timeout", "1.5"]


def peerstate_run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "peerstate", "run", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_more_spares_than_allowed(tmp_path):
    result = peerstate_run("--nproc-per-node", "2", "--spares", "3", "--log-dir", str(tmp_path), "train.py")
    assert result.returncode == 2
    assert "--spares 3 is not allowed" in result.stderr and "0 to --nproc-per-node (2)" in result.stderr


def test_several_nodes_need_a_store_address(tmp_path):
    result = peerstate_run("--nnodes", "2", "--nproc-per-node", "1", "--log-dir", str(tmp_path), "train.py")
    assert result.returncode == 2 and "--store HOST:PORT" in result.stderr


def test_script_that_fails_at_import_stops_the_job(tmp_path):
    job = Job(tmp_path, [(2, 1)], agent_args=FAST, script_args=["--fail-at-import"])
    try:
        assert job.wait(timeout=60) == [1], job.describe()
        summary = job.agent_logs[0].read_text()
        assert "cannot go on" in summary and "fails at start-up" in summary, summary
        assert "before it reached peerstate.Job(), in " in summary and "train_job.py --steps" in summary, summary
        assert "this script was told to fail at start-up" in summary, summary
    finally:
        job.close()


def test_a_spare_whose_script_fails_before_track_stops_the_job_loudly(tmp_path):
    # The workers have a RANK; a hot spare has none until track() gives it one, so this script's
    # every spare fails. Respawning them would hide that no spare can ever take a rank.
    job = Job(tmp_path, [(2, 1)], agent_args=FAST, script_args=["--read-rank-early", "--steps", "100000"])
    try:
        assert job.wait(timeout=90) == [1], job.describe()
        summary = job.agent_logs[0].read_text()
        assert summary.count("after peerstate.Job() and before it was ready to take a rank") == 3, summary
        assert "start failure 1 of 3 in a row on node 0" in summary, summary
        assert "The script fails on every hot spare before track() returns" in summary, summary
        assert "KeyError: 'RANK'" in summary, summary
        assert len(job.events("spare_started")) == 3, job.describe()
    finally:
        job.close()


def test_mismatched_world_sizes_between_agents(tmp_path):
    job = Job(tmp_path, [(2, 0), (1, 0)], agent_args=FAST)  # node 1 claims 1 process per node
    try:
        codes = job.wait(timeout=60)
        assert codes == [1, 1], job.describe()
        for log in job.agent_logs:
            assert "every agent needs the same --nnodes and --nproc-per-node" in log.read_text(), job.describe()
    finally:
        job.close()


def test_job_outside_the_launcher_says_how_to_start_it(monkeypatch):
    import peerstate

    monkeypatch.delenv("PEERSTATE_STORE", raising=False)
    with pytest.raises(peerstate.InvalidArgumentError, match="peerstate run --nproc-per-node"):
        peerstate.Job()


MODULE = """
import os
import peerstate
print("job secret in the environment:", "PEERSTATE_SECRET" in os.environ, flush=True)
with peerstate.Job() as job:
    job.track(extras={"count": 0})
    for step in job.steps(3):
        with job.guard():
            job.extras["count"] += 1
    print("module ran as", __name__, "count", job.extras["count"], flush=True)
"""


@pytest.mark.parametrize("preload", [None, ""], ids=["forked", "own-interpreter"])
def test_a_module_is_run_as_python_m_runs_it_without_the_job_secret(tmp_path, preload):
    # torchrun -m torchtitan.train ...: trainers are started as modules, from the working directory.
    # The agent is given the job secret; its workers get only credentials of their own rank.
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(MODULE)
    logs = tmp_path / "logs"
    result = subprocess.run([sys.executable, "-m", "peerstate", "run", "--nproc-per-node", "2", "--log-dir", str(logs),
                             *([] if preload is None else ["--preload", preload]), "-m", "trainer.train"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PEERSTATE_SECRET": secrets.token_hex(32)})
    assert result.returncode == 0, result.stderr + (logs / "n0.0.log").read_text()
    for worker in ("n0.0", "n0.1"):
        log = (logs / f"{worker}.log").read_text()
        assert "module ran as __main__ count 3" in log and "job secret in the environment: False" in log, log


def test_a_fault_free_run_says_nothing_a_user_must_learn_to_ignore(tmp_path):
    # c10d logged every wait of the agent's store clients that ran out on purpose (a watch, a
    # lease) as "[c10d] waitForInput ... timed out": about 20 warnings a healthy run.
    job = Job(tmp_path, [(2, 1), (2, 0)], agent_args=FAST, script_args=["--steps", "10"])
    try:
        assert job.wait(timeout=120) == [0, 0], job.describe()
        consoles = [log.read_text() for log in job.agent_logs]
    finally:
        job.close()
    said = [line for text in consoles for line in text.splitlines() if not line.startswith("peerstate: store at ")]
    # What the run owes its user: each node's closing summary of the memory it held for recoveries, once.
    summary = [line for line in said if re.match(r"peerstate: node \d: host memory a rank holds for recoveries", line)]
    assert len(summary) == 2 and [line for line in said if line not in summary] == [], said

"""`peerstate run` under Slurm: the node count, the node rank and the store's host
from the step's environment; flags on the command line win."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerstate import InvalidArgumentError
from peerstate.launcher.cluster_env import DEFAULT_STORE_PORT, first_host, slurm_defaults

TRAIN = Path(__file__).resolve().parents[1] / "helpers" / "train_job.py"


@pytest.mark.parametrize("nodelist, first", [
    ("gpu007", "gpu007"),
    ("gpu[003-005,9],cpu1", "gpu003"),
    ("rack1-node[12,14-15]-ib", "rack1-node12-ib"),
    ("a[1-2],b[3-4]", "a1"),
    ("10.0.0.5,10.0.0.6", "10.0.0.5"),
])
def test_the_first_host_of_a_slurm_hostlist(nodelist, first):
    assert first_host(nodelist) == first


def test_slurm_defaults():
    environ = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[003-006]"}
    assert slurm_defaults(environ) == {"nnodes": 4, "node_rank": 2, "store": f"gpu003:{DEFAULT_STORE_PORT}"}
    assert slurm_defaults({"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu1"}) == \
        {"nnodes": 1, "node_rank": 0}  # one node hosts its own store on a free port
    assert slurm_defaults({"PATH": "/bin"}) == {}  # not under Slurm
    with pytest.raises(InvalidArgumentError, match="must be integers: pass --nnodes and --node-rank"):
        slurm_defaults({"SLURM_NNODES": "two", "SLURM_NODEID": "0"})


@pytest.mark.e2e
def test_agents_started_as_srun_starts_them_take_their_node_from_slurm(tmp_path):
    pytest.importorskip("torch")
    secret = tmp_path / "job.secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    agents, logs = [], []
    try:
        store = "127.0.0.1:0"  # given: the Slurm default (its first host, DEFAULT_STORE_PORT) is a fixed port
        for node in (0, 1):
            env = {**os.environ, "SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": "127.0.0.1"}
            logs.append(tmp_path / f"agent{node}.log")
            with open(logs[-1], "wb") as out:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "peerstate", "run", "--store", store, "--nproc-per-node", "1",
                     "--log-dir", str(tmp_path / "logs"), "--secret-file", str(secret), "--join-timeout", "30",
                     str(TRAIN), "--steps", "4"], env=env, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
            if node == 0:
                deadline = time.monotonic() + 60
                while not re.search(r"store at (\S+)", logs[0].read_text()):
                    assert time.monotonic() < deadline and agents[0].poll() is None, logs[0].read_text()
                    time.sleep(0.1)
                store = re.search(r"store at (\S+)", logs[0].read_text()).group(1)
        codes = [agent.wait(timeout=90) for agent in agents]
        text = "".join(log.read_text() for log in logs)
        assert codes == [0, 0], text
        workers = sorted(p.name for p in (tmp_path / "logs").glob("n*.log"))
        assert workers == ["n0.0.log", "n1.0.log"], workers  # node ranks 0 and 1, from SLURM_NODEID
        assert "rank 1 done at step 4" in (tmp_path / "logs" / "n1.0.log").read_text()
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()

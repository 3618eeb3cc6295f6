"""The control plane's contracts: every store key spelled in ``control/keys.py``
alone, and the agent-to-worker environment written and read by one class."""

import re
from pathlib import Path

import pytest

import peerstate
from peerstate import InvalidArgumentError
import os
import stat

from peerstate.control.environment import WorkerEnvironment, job_secret, parse_secret

PACKAGE = Path(peerstate.__file__).parent
# The first component of every key family in keys.py.
FAMILIES = sorted({value.split("/")[0] for value in re.findall(r'(?:f?")([a-z_]+)(?:/|")', (PACKAGE / "control" / "keys.py").read_text())
                   if value not in ("",)})


def test_the_key_families_are_found():
    assert {"config", "node", "spare", "epoch", "job", "bytes", "inject", "pg"} <= set(FAMILIES)


@pytest.mark.parametrize("module", sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                                          if p.name != "keys.py"))
def test_no_module_but_keys_spells_a_store_key(module):
    source = (PACKAGE / module).read_text()
    spelled = [m.group(0) for m in re.finditer(r'f?"(%s)(/[^"\s]*)?"' % "|".join(map(re.escape, FAMILIES)), source)]
    # Words that are no keys: a dict key of an event or config, or a message.
    spelled = [s for s in spelled if "/" in s or s.strip('f"') in ("config", "spares", "nodes_joined")]
    assert spelled == [], f"{module} spells store keys {spelled}: name them through peerstate.control.keys"


def test_the_environment_round_trips():
    env = WorkerEnvironment(store="127.0.0.1:2900", worker="n1.2", spare=False, world_size=4, nproc_per_node=2,
                            node=1, host="127.0.0.2", progress="/dev/shm/p", events="/tmp/e.jsonl",
                            private_key=bytes(range(32)), job_key=bytes(32), certificate=bytes(64), rank=3,
                            checkpoint_dir="/ckpt", checkpoint_every=5,
                            node_store="127.0.0.1:2901")
    variables = env.to_env()
    assert variables["RANK"] == "3" and variables["LOCAL_RANK"] == "1" and variables["MASTER_PORT"] == "2900"
    assert WorkerEnvironment.from_env(variables) == env


def test_a_spare_gets_no_rank_nor_certificate_and_reads_back_as_a_spare():
    env = WorkerEnvironment(store="h:1", worker="n0.2", spare=True, world_size=2, nproc_per_node=2, node=0,
                            private_key=b"k" * 32, job_key=b"j" * 32, node_store="127.0.0.1:2")
    variables = env.to_env()
    assert "RANK" not in variables and "PEERSTATE_CERTIFICATE" not in variables
    assert WorkerEnvironment.from_env(variables) == env
    del variables["PEERSTATE_RANK_KEY"]
    with pytest.raises(InvalidArgumentError, match="PEERSTATE_RANK_KEY is not set"):
        WorkerEnvironment.from_env(variables)


def test_outside_peerstate_run_the_error_says_how_to_start():
    with pytest.raises(InvalidArgumentError, match="peerstate run --nproc-per-node"):
        WorkerEnvironment.from_env({})


def worker_variables():
    return WorkerEnvironment(store="h:1", worker="n0.0", spare=False, world_size=2, nproc_per_node=2, node=0,
                             rank=0, private_key=b"k" * 32, job_key=b"j" * 32, certificate=b"c" * 64,
                             node_store="127.0.0.1:2").to_env()


def test_a_malformed_variable_is_named():
    variables = worker_variables()
    with pytest.raises(InvalidArgumentError, match="malformed: .*'nine'"):
        WorkerEnvironment.from_env({**variables, "PEERSTATE_STORE": "h:nine"})
    with pytest.raises(InvalidArgumentError, match="^PEERSTATE_CERTIFICATE must be hexadecimal"):
        WorkerEnvironment.from_env({**variables, "PEERSTATE_CERTIFICATE": "zz"})


def test_a_missing_variable_is_named():
    variables = worker_variables()
    del variables["WORLD_SIZE"]
    with pytest.raises(InvalidArgumentError, match="WORLD_SIZE is not set"):
        WorkerEnvironment.from_env(variables)


@pytest.mark.parametrize("text,match", [("not-hex", "must be hexadecimal"), ("ab" * 8 + "a", "must be hexadecimal"),
                                        ("ab" * 15, "holds 15 bytes")])
def test_a_bad_secret_is_an_error_that_says_what_is_wrong(text, match):
    with pytest.raises(InvalidArgumentError, match=match):
        parse_secret(text)
    assert parse_secret("ab" * 16) == b"\xab" * 16


def test_a_bad_secret_stops_the_agent_before_any_worker_starts(monkeypatch, tmp_path):
    from peerstate.launcher.agent import Agent
    from peerstate.launcher.config import AgentConfig

    monkeypatch.setenv("PEERSTATE_SECRET", "0123")
    with pytest.raises(InvalidArgumentError, match="PEERSTATE_SECRET holds 2 bytes"):
        Agent(AgentConfig(script=["train.py"], nproc_per_node=1, log_dir=str(tmp_path)))
    assert not list(tmp_path.glob("*.log"))


def test_the_secret_comes_from_the_environment_or_a_file_never_from_the_store(tmp_path):
    assert job_secret(4, env={"PEERSTATE_SECRET": "ab" * 16}) == b"\xab" * 16
    with pytest.raises(InvalidArgumentError, match="a job of 2 nodes needs one secret on every node"):
        job_secret(2, env={})
    assert len(job_secret(1, env={})) == 32  # a one-node job: made in the agent, handed to its children
    missing = tmp_path / "absent.secret"
    with pytest.raises(InvalidArgumentError, match="does not exist: a job of 3 nodes"):
        job_secret(3, str(missing), env={})
    made = job_secret(1, str(missing), env={})  # a one-node job creates it, private
    assert stat.S_IMODE(os.stat(missing).st_mode) == 0o600
    assert job_secret(3, str(missing), env={}) == made  # and every later agent reads the same one
    os.chmod(missing, 0o644)
    with pytest.raises(InvalidArgumentError, match="readable by others"):
        job_secret(3, str(missing), env={})
    bad = tmp_path / "bad.secret"
    bad.write_text("not hex")
    os.chmod(bad, 0o600)
    with pytest.raises(InvalidArgumentError, match="the secret file .*bad.secret must be hexadecimal"):
        job_secret(1, str(bad), env={})


def test_a_two_node_agent_without_a_secret_stops_before_any_worker_starts(monkeypatch, tmp_path):
    from peerstate.launcher.agent import Agent
    from peerstate.launcher.config import AgentConfig

    monkeypatch.delenv("PEERSTATE_SECRET", raising=False)
    with pytest.raises(InvalidArgumentError, match="needs one secret on every node"):
        Agent(AgentConfig(script=["train.py"], nproc_per_node=1, nnodes=2, store="127.0.0.1:1", log_dir=str(tmp_path)))

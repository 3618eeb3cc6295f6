"""examples/kubernetes/peerstate-job.yaml: the command line each pod would run,
built from the manifest as Kubernetes builds it (``$(VAR)`` from the container's
env), is one that ``peerstate run`` accepts, with a node rank per pod and the
etcd store."""

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from peerstate.cli import parser  # noqa: E402
from peerstate.control.etcd_store import EtcdKeyValueStore  # noqa: E402
from peerstate.launcher.command_line import agent_config  # noqa: E402

MANIFEST = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "peerstate-job.yaml"


def _pod_env(container, index):
    """The container's env as the kubelet resolves it in pod ``index``."""
    fields = {"metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index),
              "metadata.labels['job-name']": "peerstate-train", "metadata.labels['controller-uid']": "1f2e",
              "status.podIP": f"10.1.0.{index + 1}"}
    env = {}
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        elif "fieldRef" in variable["valueFrom"]:
            env[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert variable["valueFrom"]["secretKeyRef"]["name"] == "peerstate-secret"
            env[variable["name"]] = "ab" * 32
    return env


def _expand(argument, env):
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), argument)


def test_each_pod_runs_a_valid_peerstate_command_for_its_node():
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    [job] = [d for d in documents if d["kind"] == "Job"]
    [service] = [d for d in documents if d["kind"] == "Service"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] == 0  # peerstate recovers, not Kubernetes
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    [container] = pod["containers"]
    nodes = spec["completions"]
    hosts = set()
    for index in range(nodes):
        env = _pod_env(container, index)
        command = [_expand(a, env) for a in container["command"]]
        assert command[:2] == ["peerstate", "run"] and not [a for a in command if "$(" in a], command
        config = agent_config(parser().parse_args(command[1:]), environ={})
        config.validate()  # what Agent() checks first
        assert (config.nnodes, config.node_rank) == (nodes, index)
        assert config.job_id == "peerstate-train-1f2e" and config.host == env["POD_IP"]
        store = EtcdKeyValueStore.for_job(config.store, config.job_id)
        assert len(store.endpoints) == 3 and {p for _, p in store.endpoints} == {2379}  # etcd's client port
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert config.nproc_per_node + config.spares <= gpus  # a spare needs a device of its own
        assert len(env["PEERSTATE_SECRET"]) >= 32
        hosts.add(config.host)
    assert len(hosts) == nodes


def test_an_etcd_store_needs_a_job_id_and_a_slurm_job_gives_one():
    from peerstate import InvalidArgumentError
    from peerstate.launcher.cluster_env import slurm_defaults

    arguments = ["run", "--nnodes", "2", "--store", "etcd://127.0.0.1:2379", "--nproc-per-node", "1", "train.py"]
    with pytest.raises(InvalidArgumentError, match="needs --job-id NAME"):
        agent_config(parser().parse_args(arguments), environ={}).validate()
    slurm = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242"}
    assert slurm_defaults(slurm)["job_id"] == "slurm-4242"
    config = agent_config(parser().parse_args(arguments), environ=slurm)
    config.validate()
    assert (config.job_id, config.node_rank) == ("slurm-4242", 1)
    with pytest.raises(InvalidArgumentError, match="needs --store HOST:PORT"):
        agent_config(parser().parse_args(["run", "--nnodes", "2", "--nproc-per-node", "1", "train.py"]), environ={})

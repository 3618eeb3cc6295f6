"""The parallelism examples of examples/ under real agents and a real kill -9: HSDP
(2 replica groups x 2 shards), FSDP2 + tensor parallelism on a 2-D mesh, a 2-stage
1F1B pipeline replicated twice, and the torchtitan-shaped trainer (meshes built by
_unflatten/_flatten from one world mesh, model parts, containers, a train state and
a stateful loader) in its FSDP2+TP, HSDP and pipeline layouts (the pipeline's: four
stages looped over two ranks, two model parts and two optimizers a rank, replicated
twice). Every rank's final state must
equal the fault-free run's, bit for bit."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from helpers.jobs import FAST, Job  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 30


def run_example(tmp_path, name, kill=None, args=()):
    out = tmp_path / "out"
    out.mkdir(parents=True)
    job = Job(tmp_path, [(2, 1), (2, 0)], steps=STEPS, agent_args=FAST, script=EXAMPLES / name, out=out,
              script_args=["--step-seconds", "0.05", *args])
    try:
        if kill is not None:
            job.wait_for_step(kill, 3, 90)
            job.kill_rank(kill)
        assert job.wait() == [0, 0], job.describe()
        assert [e["failed"] for e in job.events("recovery")] == ([[kill]] if kill is not None else []), \
            job.describe()
        if kill is not None and (name in ("hsdp.py", "pipeline.py") or "hsdp" in args or "pp" in args):
            # The shard (the stage) comes from the rank at its place in the other replica
            # group (pipeline), the free copy the mesh keeps: track(data_parallel=...).
            # The trainer's pipeline mesh is (pp, dp_replicate): its replica is the next rank.
            copy = kill ^ 1 if "pp" in args else kill ^ 2
            pulls = [(e["shares"], e["sources"]) for e in job.events("pulled") if e["replacement"]]
            assert pulls == [([0], {"0": [copy]})], job.describe()
        return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(4)}
    finally:
        job.close()


@pytest.mark.parametrize("name, kill, args", [("hsdp.py", 2, ()), ("fsdp_tp.py", 1, ()), ("pipeline.py", 3, ()),
                                              ("trainer.py", 1, ("--layout", "fsdp_tp")),
                                              ("trainer.py", 2, ("--layout", "hsdp")),
                                              ("trainer.py", 2, ("--layout", "pp"))],
                         ids=["hsdp", "fsdp-tp", "pipeline", "trainer-fsdp-tp", "trainer-hsdp", "trainer-pp"])
def test_a_killed_rank_of_a_mesh_parallel_example_recovers_bitwise(tmp_path, name, kill, args):
    reference = run_example(tmp_path / "reference", name, args=args)
    final = run_example(tmp_path / "killed", name, kill=kill, args=args)
    for rank in range(4):
        assert reference[rank].keys() == final[rank].keys()
        different = [key for key in reference[rank] if not torch.equal(final[rank][key], reference[rank][key])]
        assert not different, f"{name}: rank {rank}'s {different} differ from the fault-free run"

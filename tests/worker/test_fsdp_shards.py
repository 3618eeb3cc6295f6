"""Sharded state (FSDP2's fully_shard, DTensor): each rank registers, snapshots and
restores its own local shard, in place. Two real ranks over gloo."""

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from peerstate.tools.local import kill_all, start_plain_workers  # noqa: E402

WORKER = Path(__file__).parents[1] / "helpers" / "fsdp_shard_worker.py"


@pytest.mark.e2e
def test_each_rank_snapshots_and_restores_its_own_shard(tmp_path):
    workers = start_plain_workers([str(WORKER)], 2, tmp_path / "fsdp")
    try:
        codes = [w.wait(timeout=120) for w in workers]
    finally:
        kill_all(workers)
    logs = [Path(f"{tmp_path / 'fsdp'}.rank{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], logs
    results = [json.loads(re.search(r"^RESULT (.*)$", log, re.M).group(1)) for log in logs]
    for result in results:
        # Linear(16, 32).weight is [32, 16]: each of 2 ranks holds [16, 16], and that is what is snapshotted
        assert result["registered_shapes"]["0.weight"] == [16, 16]
        assert result["snapshot_bytes"]["0.weight"] == 16 * 16 * 4
        assert result["moments_local"] == [16, 16]
        assert result["restored"], result
        assert "optimizer/state/0/exp_avg" in result["names"]

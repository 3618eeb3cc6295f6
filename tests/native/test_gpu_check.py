"""The rehearsal of ``bench/gpu/check.sh``, the one script a lent GPU machine runs:
every step of it on the CPU, so that the one GPU run does not fail on a typo. Its
quick form: the pytest steps collect their tests (the suite runs them itself), the
snapshot benchmark runs at one small size, and the recovery runs whole (workers
killed, the final weights checked bit for bit). What a rehearsal cannot show is
whether the CUDA steps pass (bench/README.md, "The device path")."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
STEPS = ["build-info", "gpu-tests", "standin-tests", "snapshot-bench", "recovery"]


@pytest.mark.e2e
def test_the_gpu_check_script_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PEERSTATE_CHECK_DEVICE="cpu", PEERSTATE_CHECK_QUICK="1",
               PYTHON=sys.executable)
    run = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "check.sh")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    ran = {line.split()[0]: line.split()[1] for line in summary.splitlines() if " rc=" in line}
    assert ran == {step: "rc=0" for step in STEPS}, summary
    assert "bitwise check: PASS" in summary, summary
    for step in ("gpu-tests", "standin-tests"):  # every file found, none failing to import
        last = (out / f"{step}.log").read_text().strip().splitlines()[-1]
        assert re.fullmatch(r"\d+ tests? collected in .*", last), last
    rows = json.loads((out / "snapshot_cpu.json").read_text())["rows"]
    assert {"snapshot 16MiB large crc", "restore 16MiB large crc"} <= {row["case"] for row in rows}, rows
    assert all(row["ours_GBps"] > 0 and row["limit_GBps"] > 0 for row in rows), rows

"""The main job, shortened: `peerstate demo` end to end (its faults are injected by the
agents through --inject), and `peerstate goodput`."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_short_demo_recovers_bitwise_and_writes_its_report(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "peerstate", "demo", "--steps", "14", "--kill-worker-at", "4", "--kill-node-at",
         "9", "--width", "64", "--layers", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bitwise check: PASS" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["bitwise"]["equal"] and report["bitwise"]["parameters"] > 0
    assert [r["failed"] for r in report["recoveries"]] == [[1], [2, 3]]
    assert {e["fault"] for e in report["injected"]} == {"kill rank 1 after step 4", "kill-node node 1 after step 9"}
    assert report["restart_baseline"]["total_s"] > 0
    assert sorted(map(int, report["faulty"]["loss"])) == list(range(14))
    assert report["faulty"]["loss"] == report["reference"]["loss"]  # the kept losses, bit for bit
    # Each final rank's host memory for recoveries (Job.memory()), in the report and the summary:
    # at least 4 versions of what it copies a step, and both regions of its buddy's replica.
    memory = report["memory"]
    assert sorted(memory) == ["0", "1", "2", "3"], memory
    for m in memory.values():
        assert m["snapshot_per_version"] > 0 and m["snapshots_held"] >= 4 * m["snapshot_per_version"], memory
        assert m["replicas_held"] == m["replicas_reserved"] > 0, memory
    assert "host memory a rank holds for recoveries (the most of 4 ranks)" in result.stdout
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_goodput_command_prints_the_table_and_draws(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "peerstate", "goodput", "--sizes", "1024", "16384", "--results", str(tmp_path),
         "--peerstate-recovery-s", "0.5", "--monte-carlo", "10", "--png", str(tmp_path / "g.png"),
         "--json", str(tmp_path / "g.json")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "16384" in result.stdout and "recovery 0.50s" in result.stdout
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert [r["accelerators"] for r in rows] == [1024, 16384]
    assert rows[1]["closed checkpoint-restart"] == pytest.approx(0.90, abs=0.01)
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"

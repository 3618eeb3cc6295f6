"""Recovery, step overhead and goodput of the DeviceMesh examples: HSDP, FSDP2 +
tensor parallelism, a 2-stage pipeline and the torchtitan-shaped trainer in its
FSDP2+TP and HSDP layouts (examples/), and of torchtitan's own Trainer in the same
two layouts and a 2-stage pipeline of FSDP2 pairs (``torchtitan-*``:
peerstate.integrations.torchtitan, the torchtitan extra), over gloo on this machine.

Each example runs three times under `peerstate run`, 2 simulated nodes x 2
workers + 1 hot spare, in the same bench run:

- ``off``: the same script without peerstate's capture (``PEERSTATE_CAPTURE=0``:
  no snapshot, no replication; nothing else changes), fault-free: the baseline;
- ``on``: with the capture, fault-free: the step overhead is its median step
  against ``off``'s;
- ``kill``: with the capture, rank 2 killed after step ``--kill-step`` by the
  agent (``--inject``): the recovery's time from the kill to the first step
  after it (the job's recovery timeline), and the goodput, ``off``'s wall time
  over this run's (both from the first step's start to the last step's end);
  ``vs on`` is ``on``'s over this run's, the failure's cost without the
  capture's. Both include the spare the agent starts again after the kill
  (a Python process importing torch, on the same cores as the workers).

The restart row is a floor for restarting instead: ``off``'s time from launch
to its first step's end (processes, imports, groups, one step), which a
restart pays before it even loads a checkpoint.

Run: python bench/parallelisms.py [--quick] [--steps 60] [--width 1024] [--examples hsdp,trainer-hsdp]
(writes bench/results/parallelisms.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from peerstate.tools.local import LocalJob

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
RESULTS = HERE / "results" / "parallelisms.json"
# torchtitan's own Trainer (llama3 debug model, the torchtitan extra) through peerstate.integrations.torchtitan,
# with the tests' CPU shims and generated assets: its width is the debug model's, not --width.
TORCHTITAN = HERE.parent / "tests" / "helpers" / "torchtitan_job.py"
# example -> its script and arguments; the trainer is torchtitan's shape (meshes from job.build_meshes,
# model parts and containers) in two of its layouts.
CASES = {"hsdp": ["hsdp.py"], "fsdp-tp": ["fsdp_tp.py"], "pipeline": ["pipeline.py"],
         "trainer-fsdp-tp": ["trainer.py", "--layout", "fsdp_tp"], "trainer-hsdp": ["trainer.py", "--layout", "hsdp"],
         "torchtitan-hsdp": [str(TORCHTITAN), "--layout", "hsdp"],
         "torchtitan-fsdp-tp": [str(TORCHTITAN), "--layout", "fsdp_tp"],
         "torchtitan-pp": [str(TORCHTITAN), "--layout", "pp_fsdp"]}


def run(example: str, steps: int, width: int, capture: bool, kill_step: Optional[int] = None,
        timeout: float = 300.0) -> dict:
    """One job of ``example``; its job_end and recovery events, and when it started its first step."""
    agent_args = ["--inject", f"kill:rank=2:step={kill_step}"] if kill_step is not None else []
    previous = os.environ.get("PEERSTATE_CAPTURE")
    os.environ["PEERSTATE_CAPTURE"] = "1" if capture else "0"  # the agents pass it to their workers
    try:
        with tempfile.TemporaryDirectory(prefix="peerstate-parallelisms-") as tmp:
            if example.startswith("torchtitan"):
                (Path(tmp) / "out").mkdir()
                sized = ["--out", str(Path(tmp) / "out"), "--assets", str(_torchtitan_assets())]
            else:
                sized = ["--width", str(width)]
            launched = time.time()
            job = LocalJob(Path(tmp), [(2, 1), (2, 0)],
                           [str(EXAMPLES / CASES[example][0]), *CASES[example][1:], "--steps", str(steps), *sized],
                           agent_args=agent_args)
            try:
                codes = job.wait(timeout)
                if codes != [0, 0]:
                    raise RuntimeError(f"{example} failed ({codes}): {job.agent_logs[0].read_text()[-2000:]}")
                [end] = job.events("job_end")
                recoveries = job.events("recovery")
            finally:
                job.close()
    finally:
        if previous is None:
            os.environ.pop("PEERSTATE_CAPTURE", None)
        else:
            os.environ["PEERSTATE_CAPTURE"] = previous
    started = end["time"] - end["wall_s"]
    if kill_step is not None and len(recoveries) != 1:
        raise RuntimeError(f"{example}: expected one recovery, found {len(recoveries)}")
    return {"wall_s": end["wall_s"], "median_step_s": end["median_step_s"],
            "first_step_end_s": started - launched + end["median_step_s"],
            "recovery_s": recoveries[0]["total_s"] if recoveries else None,
            "phases_s": recoveries[0]["phases_s"] if recoveries else None}


_ASSETS: list = []


def _torchtitan_assets() -> Path:
    """The tokenizer and dataset the tests make, made once per bench run (removed at its end)."""
    import atexit
    import shutil
    import sys

    if not _ASSETS:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from helpers.torchtitan_assets import make_assets

        root = Path(tempfile.mkdtemp(prefix="peerstate-torchtitan-assets-"))
        atexit.register(shutil.rmtree, root, True)
        _ASSETS.append(make_assets(root))
    return _ASSETS[0]


def measure(example: str, steps: int, width: int, kill_step: int) -> dict:
    off = run(example, steps, width, capture=False)
    on = run(example, steps, width, capture=True)
    killed = run(example, steps, width, capture=True, kill_step=kill_step)
    return {
        "example": example, "steps": steps, "width": width,
        "step_off_ms": off["median_step_s"] * 1e3, "step_on_ms": on["median_step_s"] * 1e3,
        "overhead_pct": (on["median_step_s"] / off["median_step_s"] - 1) * 100,
        "recovery_s": killed["recovery_s"], "phases_s": killed["phases_s"],
        "restart_floor_s": off["first_step_end_s"],
        "restart_floor_over_recovery": off["first_step_end_s"] / killed["recovery_s"],
        "goodput_vs_off": off["wall_s"] / killed["wall_s"],
        "goodput_vs_on": on["wall_s"] / killed["wall_s"],  # the failure's share alone, the capture's cost aside
        "wall_off_s": off["wall_s"], "wall_on_s": on["wall_s"], "wall_kill_s": killed["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, width 256, one round")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="rounds per example (medians)")
    parser.add_argument("--examples", default=",".join(CASES),
                        help="which (comma-separated); the rows of the others in the results file are kept")
    args = parser.parse_args()
    steps, width, repeat = (30, 256, 1) if args.quick else (args.steps, args.width, args.repeat)
    rows = []
    for example in args.examples.split(","):
        rounds = [measure(example, steps, width, kill_step=steps // 3) for _ in range(repeat)]
        row = {key: value for key, value in rounds[0].items() if key != "phases_s"}
        for key in ("step_off_ms", "step_on_ms", "overhead_pct", "recovery_s", "restart_floor_s",
                    "restart_floor_over_recovery", "goodput_vs_off", "goodput_vs_on", "wall_off_s", "wall_on_s",
                    "wall_kill_s"):
            row[key] = statistics.median(r[key] for r in rounds)
        row["rounds"] = repeat
        row["per_round"] = [{key: r[key] for key in ("recovery_s", "phases_s", "goodput_vs_off", "overhead_pct")}
                            for r in rounds]  # medians hide a slow tail: every round is kept
        rows.append(row)
    print(f"{'example':<16} {'step off ms':>11} {'step on ms':>10} {'overhead':>9} {'recovery s':>10} "
          f"{'restart floor s':>15} {'floor/recovery':>14} {'goodput vs off':>14} {'vs on':>7}")
    for row in rows:
        print(f"{row['example']:<16} {row['step_off_ms']:>11.2f} {row['step_on_ms']:>10.2f} "
              f"{row['overhead_pct']:>8.1f}% {row['recovery_s']:>10.3f} {row['restart_floor_s']:>15.2f} "
              f"{row['restart_floor_over_recovery']:>13.1f}x {row['goodput_vs_off']:>13.1%} "
              f"{row['goodput_vs_on']:>6.1%}")
    RESULTS.parent.mkdir(exist_ok=True)
    kept = [row for row in json.loads(RESULTS.read_text()) if row["example"] not in args.examples.split(",")] \
        if RESULTS.exists() else []
    RESULTS.write_text(json.dumps(kept + rows, indent=1))
    for row in rows:
        print(f"{row['example']}: recovery per round " + ", ".join(f"{r['recovery_s']:.3f}s" for r in row["per_round"]))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

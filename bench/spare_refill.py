"""Spare refill benchmark: how soon a used hot spare is replaced, and what that
does to a second failure that comes before it is.

The same job twice in one run (the demo's GPT under DDP, bench/soak_job.py;
node 0 with 2 workers and 1 hot spare, node 1 with 2 workers and none, so a
second failure on node 0 needs the refilled spare):

- forked: workers and spares forked from the node's fork server, which has
  imported torch and peerstate once (``peerstate run``'s default, ``--preload``);
- fresh: each started with its own interpreter (``--preload ''``, as torchrun
  starts workers).

The agent kills rank 0 after step ``--first`` and rank 1 after step
``--first + --gap`` (``--inject``): the second kill lands while the spare that
replaced rank 0 is being refilled. Measured, from the job's event log: each
refilled spare's start to ready (``spare_started`` to ``spare_ready``: the
process's start, its imports, its script up to ``track()``'s wait; the
initial spare is left out, as the fork server's own start precedes it), and each recovery's
fault to first step (the ``recovery`` events' ``total_s``). Both modes run on
the same 2 cores, one after the other, ``--repeat`` times each.

    python bench/spare_refill.py            # bench/results/spare_refill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from peerstate.tools.local import LocalJob

HERE = Path(__file__).resolve().parent
JOB = HERE / "soak_job.py"
RESULTS = HERE / "results" / "spare_refill.json"
MODES = {"forked": [], "fresh": ["--preload", ""]}


def one_run(work: Path, preload_flags: list, first: int, gap: int, timeout: float) -> dict:
    steps = first + gap + 30
    job = LocalJob(work, [(2, 1), (2, 0)],
                   [str(JOB), "--steps", str(steps), "--out", str(work / "final.pt"), "--step-seconds", "0.1"],
                   agent_args=[*preload_flags, "--lease-timeout", "1.5", "--spare-timeout", "60",
                               "--inject", f"kill:rank=0:step={first}", "--inject", f"kill:rank=1:step={first + gap}"])
    try:
        codes = job.wait(timeout)
        if codes != [0, 0]:
            raise RuntimeError(f"the job failed ({codes}):\n{job.agent_logs[0].read_text()[-2000:]}")
        started = {e["worker"]: e["time"] for e in job.events("spare_started")}
        ready = {e["source"]: e["time"] for e in job.events("spare_ready")}
        recoveries = sorted(job.events("recovery"), key=lambda e: e["epoch"])
    finally:
        job.close()
    if len(recoveries) != 2:
        raise RuntimeError(f"expected 2 recoveries, got {len(recoveries)} (logs in {work})")
    refills = sorted(started.items(), key=lambda item: item[1])[1:]  # the first is the initial spare
    return {"spare_ready_s": [ready[w] - t for w, t in refills if w in ready],
            "first_recovery_s": recoveries[0]["total_s"], "second_recovery_s": recoveries[1]["total_s"],
            "second_phases_s": recoveries[1]["phases_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--first", type=int, default=20, help="rank 0 is killed after this step")
    parser.add_argument("--gap", type=int, default=8, help="steps (0.1 s each) from the first kill to the second")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    runs = {mode: [] for mode in MODES}
    for index in range(args.repeat):
        for mode, flags in MODES.items():
            work = Path(tempfile.mkdtemp(prefix=f"peerstate-refill-{mode}-"))
            runs[mode].append(one_run(work, flags, args.first, args.gap, args.timeout))
            print(f"run {index} {mode}: {runs[mode][-1]}", flush=True)
    rows = []
    for mode in MODES:
        ready = [s for r in runs[mode] for s in r["spare_ready_s"]]
        rows.append({"mode": mode, "spare_ready_p50_s": round(statistics.median(ready), 3),
                     "spare_ready_max_s": round(max(ready), 3),
                     "first_recovery_p50_s": round(statistics.median(r["first_recovery_s"] for r in runs[mode]), 3),
                     "second_recovery_p50_s": round(statistics.median(r["second_recovery_s"] for r in runs[mode]), 3),
                     "second_recovery_max_s": round(max(r["second_recovery_s"] for r in runs[mode]), 3),
                     "runs": runs[mode]})
    forked, fresh = rows
    print(f"\n{'mode':<8}{'spare ready p50':>16}{'max':>8}{'1st recovery':>14}{'2nd recovery p50':>18}{'max':>8}")
    for row in rows:
        print(f"{row['mode']:<8}{row['spare_ready_p50_s']:>15.2f}s{row['spare_ready_max_s']:>7.2f}s"
              f"{row['first_recovery_p50_s']:>13.2f}s{row['second_recovery_p50_s']:>17.2f}s"
              f"{row['second_recovery_max_s']:>7.2f}s")
    ratios = {"spare_ready": round(fresh["spare_ready_p50_s"] / forked["spare_ready_p50_s"], 1),
              "second_recovery": round(fresh["second_recovery_p50_s"] / forked["second_recovery_p50_s"], 1)}
    print(f"fresh / forked: spare ready {ratios['spare_ready']}x, second recovery {ratios['second_recovery']}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"benchmark": "spare_refill", "command": " ".join(
        ["python", "bench/spare_refill.py", *(argv if argv is not None else sys.argv[1:])]), "first": args.first,
        "gap": args.gap, "ratios_fresh_over_forked": ratios, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

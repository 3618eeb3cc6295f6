"""Memory drift without faults: the baseline for the soak's memory growth.

The soak (``bench/soak.py``) reports each worker's resident memory after each
recovery and its growth over the worker's life. A worker's memory also moves
with no recovery at all (its warm-up over its first steps, then the
allocator's drift), so the soak's figure is read against this one: the same
job (``bench/soak_job.py``: the demo's GPT under DDP, 2 simulated nodes x
(2 workers + 1 hot spare), a disk checkpoint every 20 steps, a step paced to
0.1 s) with no fault, each rank's resident memory sampled every
``--every`` seconds. Reported per rank: memory at its first sample, at the
end of the warm-up (``--warm-up`` seconds after the first step), at the end,
and the growth after the warm-up. Measured: all of it.

    python bench/memory_drift.py        # ~90 s; results/memory_drift.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--every", type=float, default=4.0, help="seconds between samples")
    parser.add_argument("--warm-up", type=float, default=12.0, help="seconds after the first sample")
    parser.add_argument("--out", default=str(HERE / "results" / "memory_drift.json"))
    args = parser.parse_args()

    from peerstate.tools.local import LocalJob, resident_bytes

    samples = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = LocalJob(Path(tmp), [(2, 1), (2, 1)],
                       [str(HERE / "soak_job.py"), "--steps", str(args.steps), "--out", str(Path(tmp) / "final.pt"),
                        "--step-seconds", "0.1"],
                       agent_args=["--job-id", "drift", "--checkpoint-dir", str(Path(tmp) / "checkpoints"),
                                   "--checkpoint-every", "20"])
        try:
            start = None
            while any(agent.poll() is None for agent in job.agents):
                for rank, pids in job.rank_pids().items():
                    resident = resident_bytes(pids[-1])
                    if resident:
                        start = start or time.monotonic()
                        samples.setdefault(rank, []).append((time.monotonic() - start, resident))
                time.sleep(args.every)
            codes = [agent.wait() for agent in job.agents]
        finally:
            job.close()
    if codes != [0, 0]:
        raise SystemExit(f"the job failed (agents exited {codes})")
    rows = []
    for rank, series in sorted(samples.items()):
        series = series[:-1]  # the last sample may be taken while the worker exits
        warm = next(((t, m) for t, m in series if t >= args.warm_up), series[-1])
        rows.append({"rank": rank, "first_mib": series[0][1] / 2**20, "warm_mib": warm[1] / 2**20,
                     "end_mib": series[-1][1] / 2**20, "seconds": series[-1][0] - warm[0],
                     "growth_after_warm_up": series[-1][1] / warm[1] - 1,
                     "growth_from_first": series[-1][1] / series[0][1] - 1})
    print(f"{'rank':>4} {'first MiB':>9} {'at ' + format(args.warm_up, 'g') + ' s':>9} {'end MiB':>8} "
          f"{'after warm-up':>13} {'from first':>10}")
    for row in rows:
        print(f"{row['rank']:>4} {row['first_mib']:>9.0f} {row['warm_mib']:>9.0f} {row['end_mib']:>8.0f} "
              f"{row['growth_after_warm_up']:>+13.1%} {row['growth_from_first']:>+10.1%}")
    Path(args.out).write_text(json.dumps({"benchmark": "memory_drift", "command": " ".join(["python", *sys.argv]),
                                          "steps": args.steps, "warm_up_s": args.warm_up, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

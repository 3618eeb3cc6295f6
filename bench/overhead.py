"""Step overhead of every-step snapshots + replication, on the demo's GPT.

4 workers (2 simulated nodes x 2, DDP over gloo) run blocks of steps with
peerstate's capture on and off, interleaved in the same run (on, off, on, ...),
so that both see the same machine. The overhead of each on-block is measured
against the mean of the off-blocks beside it; the table gives the mean and the
spread (standard deviation, min, max) over those pairs.

Run: python bench/overhead.py [--quick]   (writes bench/results/overhead.json)
"""

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from peerstate.local import LocalJob

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "overhead.json"


def run(blocks: int, block_steps: int, timeout: float = 900.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="peerstate-overhead-") as tmp:
        job = LocalJob(Path(tmp), [(2, 0), (2, 0)], [str(HERE / "overhead_job.py"), "--blocks", str(blocks),
                                                     "--block-steps", str(block_steps)])
        try:
            codes = job.wait(timeout)
            if codes != [0, 0]:
                raise RuntimeError(f"the job failed ({codes}): {job.agent_logs[0].read_text()[-2000:]}")
            lines = re.findall(r"^step (\d+) (on|off) (\S+)", job.text(), re.M)
        finally:
            job.close()
    steps = [(int(s), mode, float(t)) for s, mode, t in lines]
    per_block = {}
    for step, mode, seconds in steps:
        per_block.setdefault(len(per_block) if not per_block or list(per_block.values())[-1][0] != mode
                             else len(per_block) - 1, (mode, []))[1].append(seconds)
    medians = [(mode, statistics.median(times)) for mode, times in per_block.values()]
    overheads = []
    for i, (mode, on) in enumerate(medians):
        if mode != "on":
            continue
        offs = [m for j, (mm, m) in enumerate(medians) if mm == "off" and abs(j - i) == 1]
        if offs:
            overheads.append(100.0 * (on / statistics.mean(offs) - 1.0))
    on_all = [t for _, m, t in steps if m == "on"]
    off_all = [t for _, m, t in steps if m == "off"]
    return {"overheads_percent": overheads, "on_median_s": statistics.median(on_all),
            "off_median_s": statistics.median(off_all), "steps": len(steps), "blocks": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 blocks of 8 steps")
    args = parser.parse_args()
    blocks, block_steps = (6, 8) if args.quick else (12, 12)
    print(f"step overhead of every-step capture: demo GPT, 4 workers, {blocks} interleaved blocks of "
          f"{block_steps} steps")
    result = run(blocks, block_steps)
    overheads = result["overheads_percent"]
    summary = {"overhead_percent": statistics.mean(overheads),
               "spread_percent": statistics.stdev(overheads) if len(overheads) > 1 else 0.0,
               "min_percent": min(overheads), "max_percent": max(overheads),
               "step_s_capture_off": result["off_median_s"], "step_s_capture_on": result["on_median_s"],
               "pairs": len(overheads)}
    print(f"{'capture':<10}{'median step s':>15}")
    print(f"{'off':<10}{result['off_median_s']:>15.4f}")
    print(f"{'on':<10}{result['on_median_s']:>15.4f}")
    print(f"overhead per step: {summary['overhead_percent']:+.2f}% (std {summary['spread_percent']:.2f}%, "
          f"min {summary['min_percent']:+.2f}%, max {summary['max_percent']:+.2f}%, {len(overheads)} block pairs)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "overhead", "time": time.time(), "summary": summary,
                                   "blocks": result["blocks"], "rows": [
                                       {"case": "every-step snapshot + replication", "ours_s": result["on_median_s"],
                                        "limit_s": result["off_median_s"],
                                        "ratio": result["on_median_s"] / result["off_median_s"]}]}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

"""Step overhead of every-step snapshots + replication, on the demo's GPT.

4 workers (2 simulated nodes x 2, DDP over gloo) run blocks of steps with
peerstate's capture on and off, interleaved in the same run (on, off, on, ...),
so that both see the same machine. The overhead of each on-block is measured
against the mean of the off-blocks beside it; the table gives the mean and the
spread (standard deviation, min, max) over those pairs.

Two measures per step: wall time (what the target is about) and the CPU time
rank 0's process used (all its threads). With 4 workers on fewer cores, wall
time follows the CPU the workers need; the CPU measure is much less noisy and
says what the capture itself costs.

The data-parallel state is snapshotted in shares, one per worker of a node (the
default); ``--data-parallel-shares 1`` measures a full copy on every rank.

``--breakdown`` also times the boundary's parts on rank 0's training thread and
splits its CPU between that thread and the others, beside one thread's copy of
the bytes a step snapshots (see ``step_breakdown``; the timers cost ~1 us a call).

``--model 100m``: the same GPT at 768 wide and 14 layers (99.3M parameters, 1.2 GB
of state with AdamW's), 1 worker per node by default (4 would not fit 24 GiB
with their versions and replicas), so each rank snapshots the whole 1.2 GB every
step (it pushes only its own small state: the data-parallel state is on every
rank already); with the breakdown, whose copy limit is the figure to compare the
overhead with.

``--versions 3``: the job's eager pipeline (``Job(versions=3)``: each version copied
at its step's end and its push waited for at the next optimizer step), one version
fewer in memory; ``--versions 2``: the synced one (copied beside the next forward,
pushed once copied, waited for where that forward returns), two fewer; each run's own capture-off blocks are its baseline.

``--sharded``: 4 simulated nodes of 1 worker, each tracking the whole state as its
own (``track(data_parallel=False)``), as an FSDP shard is tracked: every step pushes
it whole, to a buddy (k=1) or, with ``--parity-group 4``, as pieces to its parity
group (``Job(parity_group=4)``). Each run's capture-off blocks are its baseline;
run both for the comparison.

Run: python bench/overhead.py [--quick] [--workers-per-node N] [--data-parallel-shares N] [--breakdown]
[--model demo|100m] [--versions N] [--sharded [--parity-group G]]
(writes bench/results/overhead.json; overhead_shares{N}.json with --data-parallel-shares;
overhead_sharded.json, overhead_sharded_parity{G}.json with --sharded;
overhead_breakdown.json with --breakdown; overhead_100m.json with --model 100m; the name
ends in _versions{N} with --versions other than 4)
"""

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from peerstate.tools.local import LocalJob
from step_breakdown import parse as parse_breakdown
from step_breakdown import table as breakdown_table

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "overhead.json"


# The job's model arguments per --model.
MODELS = {"demo": [], "100m": ["--width", "768", "--layers", "14", "--heads", "12", "--batch", "2"]}


def run(blocks: int, block_steps: int, workers_per_node: int = 2, shares: Optional[int] = None,
        timeout: float = 900.0, breakdown: bool = False, model: str = "demo", versions: int = 4,
        sharded: bool = False, parity_group: int = 0) -> dict:
    script = [str(HERE / "overhead_job.py"), "--blocks", str(blocks), "--block-steps", str(block_steps),
              "--versions", str(versions), *MODELS[model]]
    nodes = [(workers_per_node, 0)] * 2
    if sharded:
        script += ["--own-state", "--parity-group", str(parity_group)]
        nodes = [(1, 0)] * 4
    if shares is not None:
        script += ["--data-parallel-shares", str(shares)]
    if breakdown:
        script.append("--breakdown")
    with tempfile.TemporaryDirectory(prefix="peerstate-overhead-") as tmp:
        job = LocalJob(Path(tmp), nodes, script)
        try:
            codes = job.wait(timeout)
            if any(codes):
                raise RuntimeError(f"the job failed ({codes}): {job.agent_logs[0].read_text()[-2000:]}")
            text = job.text()
        finally:
            job.close()
    lines = re.findall(r"^step (\d+) (on|off) (\S+) (\S+)", text, re.M)
    steps = [(mode, float(wall), float(cpu)) for _, mode, wall, cpu in lines]
    return {measure: block_overheads([(mode, values[i]) for mode, *values in steps])
            for i, measure in enumerate(("wall", "cpu"))} | {"steps": len(steps)} | \
        ({"breakdown": parse_breakdown(text)} if breakdown else {})


def block_overheads(steps: list) -> dict:
    """(mode, seconds) per step, in order -> each block's median, and each on-block's
    overhead in percent against the mean of the off-blocks beside it."""
    blocks = []
    for mode, seconds in steps:
        if not blocks or blocks[-1][0] != mode:
            blocks.append((mode, []))
        blocks[-1][1].append(seconds)
    medians = [(mode, statistics.median(times)) for mode, times in blocks]
    overheads = []
    for i, (mode, on) in enumerate(medians):
        offs = [m for j, (mm, m) in enumerate(medians) if mm == "off" and abs(j - i) == 1]
        if mode == "on" and offs:
            overheads.append(100.0 * (on / statistics.mean(offs) - 1.0))
    return {"overheads_percent": overheads, "blocks": medians,
            "on_median_s": statistics.median(t for m, t in steps if m == "on"),
            "off_median_s": statistics.median(t for m, t in steps if m == "off")}


def summarize(measure: dict) -> dict:
    overheads = measure["overheads_percent"]
    return {"overhead_percent": statistics.mean(overheads),
            "spread_percent": statistics.stdev(overheads) if len(overheads) > 1 else 0.0,
            "min_percent": min(overheads), "max_percent": max(overheads),
            "capture_off_s": measure["off_median_s"], "capture_on_s": measure["on_median_s"],
            "pairs": len(overheads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 blocks of 8 steps (default: 32 of 12)")
    parser.add_argument("--workers-per-node", type=int, default=None,
                        help="workers on each of the 2 simulated nodes (default 2: the demo's 4 workers; "
                             "1 with --model 100m)")
    parser.add_argument("--model", choices=sorted(MODELS), default="demo",
                        help="the demo's GPT (1.8M parameters) or one of 99.3M (implies --breakdown)")
    parser.add_argument("--data-parallel-shares", type=int, default=None,
                        help="Job(data_parallel_shares=N); default: one share per worker of a node")
    parser.add_argument("--breakdown", action="store_true", help="time the step boundary's parts too")
    parser.add_argument("--versions", type=int, default=4,
                        help="Job(versions=N): 3 runs the eager pipeline, 2 the synced one (the copy and the push "
                             "on the step's path)")
    parser.add_argument("--sharded", action="store_true",
                        help="4 nodes of 1 worker, the state tracked as each rank's own (pushed whole every step)")
    parser.add_argument("--parity-group", type=int, default=0, help="with --sharded: Job(parity_group=G)")
    args = parser.parse_args()
    large = args.model == "100m"
    args.breakdown = args.breakdown or large
    per_node = args.workers_per_node or (1 if large else 2)
    blocks, block_steps = ((4, 4) if large else (6, 8)) if args.quick else ((16, 6) if large else (32, 12))
    if args.sharded:
        per_node = 1
    workers = 4 if args.sharded else 2 * per_node
    shares = args.data_parallel_shares or per_node
    print(f"step overhead of every-step capture: {'99.3M-parameter' if large else 'demo'} GPT, {workers} workers "
          f"on {os.cpu_count()} cores, {blocks} interleaved blocks of {block_steps} steps, data-parallel state in "
          f"{shares} share(s), {args.versions} versions" + (
              f"; sharded: each rank's whole state its own, on 4 nodes, "
              f"{f'parity groups of {args.parity_group}' if args.parity_group else 'a buddy (k=1)'}"
              if args.sharded else ""))
    result = run(blocks, block_steps, per_node, args.data_parallel_shares, breakdown=args.breakdown,
                 timeout=3600.0 if large else 900.0, model=args.model, versions=args.versions,
                 sharded=args.sharded, parity_group=args.parity_group)
    wall, cpu = summarize(result["wall"]), summarize(result["cpu"])
    print(f"{'per step (median)':<34}{'capture off':>12}{'capture on':>12}{'overhead: mean of block pairs':>31}"
          f"{'std':>7}{'min':>9}{'max':>9}")
    for label, summary in (("wall time (s)", wall), ("CPU time of rank 0's process (s)", cpu)):
        print(f"{label:<34}{summary['capture_off_s']:>12.4f}{summary['capture_on_s']:>12.4f}"
              f"{summary['overhead_percent']:>+30.2f}%{summary['spread_percent']:>6.2f}%"
              f"{summary['min_percent']:>+8.2f}%{summary['max_percent']:>+8.2f}%")
    print(f"({wall['pairs']} block pairs, {result['steps']} steps)")
    added = None
    if args.breakdown:
        print("\n".join(breakdown_table(result["breakdown"], wall["capture_off_s"])))
        added = wall["overhead_percent"] / 100 * wall["capture_off_s"]
        print(f"wall overhead a step {added * 1e3:.1f} ms = {added / result['breakdown']['copy_s']:.2f}x one "
              f"thread's copy of the step's bytes ({result['breakdown']['copy_s'] * 1e3:.1f} ms)")
    path = RESULTS
    if args.data_parallel_shares:
        path = RESULTS.with_name(f"overhead_shares{args.data_parallel_shares}.json")
    if args.breakdown:
        path = RESULTS.with_name("overhead_breakdown.json")
    if large:
        path = RESULTS.with_name("overhead_100m.json")
    if args.sharded:
        path = RESULTS.with_name(f"overhead_sharded{f'_parity{args.parity_group}' if args.parity_group else ''}.json")
    if args.versions != 4:
        path = path.with_name(f"{path.stem}_versions{args.versions}.json")
    path.parent.mkdir(exist_ok=True)
    rows = [{"case": f"every-step snapshot + replication, {measure}", "ours_s": summary["capture_on_s"],
             "limit_s": summary["capture_off_s"], "ratio": summary["capture_on_s"] / summary["capture_off_s"]}
            for measure, summary in (("wall", wall), ("CPU of rank 0", cpu))]
    if added is not None:
        rows.append({"case": "wall overhead a step vs one thread's copy of the step's bytes", "ours_s": added,
                     "limit_s": result["breakdown"]["copy_s"], "ratio": added / result["breakdown"]["copy_s"]})
    path.write_text(json.dumps({
        "benchmark": "overhead", "time": time.time(), "model": args.model, "workers": workers, "cores": os.cpu_count(),
        "data_parallel_shares": shares, "versions": args.versions, "breakdown": result.get("breakdown"),
        "sharded": args.sharded, "parity_group": args.parity_group,
        "summary": wall, "cpu_summary": cpu, "blocks": result["wall"]["blocks"], "cpu_blocks": result["cpu"]["blocks"],
        "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

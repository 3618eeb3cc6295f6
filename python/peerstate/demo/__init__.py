"""``peerstate demo``: train a small GPT on 4 workers + 1 hot spare, kill ranks and a
whole node, recover without a checkpoint, and show what it cost.

Three runs on this machine, all on 127.0.0.1:
1. the reference: the same seed, no failure;
2. the demo: 2 simulated nodes (2 workers + 1 spare, and 2 workers), with the
   failures injected by the agents at steps chosen up front;
3. the classic way, on the same state: 4 fresh processes load a torch.save
   checkpoint and run one step (the floor of a restart: no detection, no
   rescheduling).
Then the final weights of 1 and 2 are compared bit for bit, and a report is
written: report.json and report.png (loss vs step with the failures, and the
recovery timelines).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import List, Optional

from peerstate.tools.local import LocalJob, kill_all, start_plain_workers

TRAIN = Path(__file__).with_name("train.py")


class _StatusLine:
    """One line on stderr, redrawn in place on a terminal; elsewhere printed only
    when the step or the number of recoveries changed."""

    def __init__(self, job: LocalJob, label: str, steps: int) -> None:
        self.job, self.label, self.steps = job, label, steps
        self.started = time.monotonic()
        self.shown = None
        self.terminal = sys.stderr.isatty()

    def __call__(self) -> None:
        found = [int(s) for s in re.findall(r"^rank \d+ step (\d+)", self.job.text(), re.M)]
        done = max(found, default=-1) + 1
        recoveries = len(self.job.events("recovery"))
        if not self.terminal and (done // 10, recoveries) == self.shown:
            return
        self.shown = (done // 10, recoveries)
        bar = "#" * int(24 * done / self.steps)
        line = (f"  {self.label:<10} [{bar:<24}] step {done:>3}/{self.steps}  recoveries {recoveries}  "
                f"{time.monotonic() - self.started:5.1f}s")
        sys.stderr.write(f"\r{line} " if self.terminal else line + "\n")
        sys.stderr.flush()


def _run(out: Path, label: str, nodes, script: List[str], agent_args: List[str], steps: int, timeout: float):
    started = time.monotonic()
    job = LocalJob(out / label, nodes, script, agent_args=agent_args)
    try:
        status = _StatusLine(job, label, steps)
        codes = job.wait(timeout, tick=status)
        status.shown = None
        status()
        if status.terminal:
            sys.stderr.write("\n")
        return job, codes, time.monotonic() - started
    finally:
        job.close()


def _losses(job: LocalJob) -> dict:
    """step -> loss, the value that was kept (a replayed step's last one), and the
    steps that were computed more than once."""
    kept, seen = {}, {}
    for step, value, _ in re.findall(r"^loss (\d+) (\S+) (\S+)", job.text(), re.M):
        kept[int(step)] = float(value)
        seen[int(step)] = seen.get(int(step), 0) + 1
    return {"loss": kept, "replayed": sorted(s for s, n in seen.items() if n > 1)}


def _restart_baseline(out: Path, checkpoint: Path, model_args: List[str], timeout: float) -> dict:
    prefix = out / "restart" / "baseline"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    spawned = time.time()
    workers = start_plain_workers([str(TRAIN), "--out", str(out / "restart"), "--restart-from", str(checkpoint),
                                   *model_args], 4, prefix)
    try:
        deadline = time.monotonic() + timeout
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [re.search(r"baseline started (\S+) loaded (\S+) stepped (\S+)",
                           Path(f"{prefix}.rank{r}.log").read_text()) for r in range(4)]
        if not all(lines):
            raise RuntimeError(f"the restart baseline failed: {Path(f'{prefix}.rank0.log').read_text()[-1500:]}")
    finally:
        kill_all(workers)
    started = max(float(m.group(1)) for m in lines)
    loaded = max(float(m.group(2)) for m in lines)
    stepped = max(float(m.group(3)) for m in lines)
    return {"phases_s": {"start processes, import torch": started - spawned,
                         "form group, build model, load checkpoint": loaded - started,
                         "first step after the restart": stepped - loaded},
            "total_s": stepped - spawned}


def _bitwise(reference: Path, faulty: Path) -> dict:
    import torch

    a, b = torch.load(reference, map_location="cpu"), torch.load(faulty, map_location="cpu")
    different = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    return {"equal": not different and a.keys() == b.keys(), "tensors": len(a), "different": different,
            "parameters": sum(t.numel() for t in a.values())}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="peerstate demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-worker-at", type=int, default=15, help="kill -9 rank 1 after this step (-1: no)")
    parser.add_argument("--kill-node-at", type=int, default=35, help="kill node 1 after this step (-1: no)")
    parser.add_argument("--inject", action="append", default=[], help="more faults (peerstate run --inject)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="peerstate-demo", help="the report folder")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--device", default="cpu", help="where the workers keep the model: cpu, or cuda (all on "
                        "the one GPU, process groups over gloo; bench/gpu/check.sh)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_args = ["--seed", str(args.seed), "--width", str(args.width), "--layers", str(args.layers),
                  "--device", args.device]
    faults = list(args.inject)
    if args.kill_worker_at >= 0:
        faults.append(f"kill:rank=1:step={args.kill_worker_at}")
    if args.kill_node_at >= 0:
        faults.append(f"kill-node:node=1:step={args.kill_node_at}")
    fast = ["--lease-timeout", "1.5", "--hang-timeout", "5"]
    print(f"peerstate demo: a {args.layers}-layer GPT (width {args.width}) on generated text, 4 workers over "
          f"2 simulated nodes + 1 hot spare, {args.steps} steps; faults: {', '.join(faults) or 'none'}")

    def script(label: str) -> List[str]:
        return [str(TRAIN), "--steps", str(args.steps), "--out", str(out / label), *model_args]

    reference, codes, reference_s = _run(out, "reference", [(4, 0)], script("reference"), fast, args.steps,
                                         args.timeout)
    if codes != [0]:
        print(f"the reference run failed (exit {codes}); see {reference.logs}", file=sys.stderr)
        return 1
    injects = [flag for fault in faults for flag in ("--inject", fault)]
    faulty, codes, faulty_s = _run(out, "faulty", [(2, 1), (2, 0)], script("faulty"), fast + injects,
                                   args.steps, args.timeout)
    node_killed = args.kill_node_at >= 0
    if codes[0] != 0 or (codes[1] != 0 and not node_killed):
        print(f"the run with failures failed (exit {codes}): {faulty.agent_logs[0].read_text()[-1500:]}",
              file=sys.stderr)
        return 1
    baseline = _restart_baseline(out, out / "faulty" / "checkpoint", model_args, args.timeout)
    check = _bitwise(out / "reference" / "final.pt", out / "faulty" / "final.pt")
    from peerstate.control.memory_figures import MEMORY_FIELDS, latest_per_rank
    from peerstate.demo.report import draw, summary

    recoveries = faulty.events("recovery")
    [end] = faulty.events("job_end") or [{}]
    report = {
        "steps": args.steps, "faults": faults, "seconds": {"reference": reference_s, "faulty": faulty_s},
        "reference": _losses(reference), "faulty": _losses(faulty),
        "injected": [e for e in faulty.events("fault_injected")],
        "recoveries": recoveries, "goodput": end.get("goodput"), "job_end": end,
        "memory": {rank: {k: e.get(k) for k in (*MEMORY_FIELDS, "node_share")}
                   for rank, e in latest_per_rank(faulty.events("memory")).items()},
        "restart_baseline": baseline, "bitwise": check,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(summary(report))
    drawn = draw(report, out / "report.png")
    print(f"report: {out / 'report.json'}" + (f" and {out / 'report.png'}" if drawn else
                                              " (no PNG: pip install 'peerstate[demo]' for matplotlib)"))
    return 0 if check["equal"] else 1

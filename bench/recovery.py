"""Recovery benchmark: from `kill -9` of a worker to the job's first completed step.

Two ways of recovering the same job (4 workers, DDP over gloo, ``--state-mib``
of state per rank; bench/recovery_job.py), measured in the same run:

- peerstate: 2 simulated nodes x 2 workers + 1 hot spare under `peerstate run`;
  the agent kills rank 2 after step K (``--inject``); the spare takes its place
  and pulls its state (DDP's state from the surviving ranks' own snapshots of
  their shares of it, its own RNG state from its buddy; with ``--replicated``
  everything from its buddy), the survivors roll back in place and pull the
  data-parallel share they do not snapshot. The phases come from the job's
  recovery timeline (events.jsonl).
- restart (the classic way, as torchrun's elastic agent does it): the bench
  sees the death with waitpid, stops every other worker, starts all 4 again,
  and each loads its torch.save checkpoint from local disk (still in the page
  cache: the most favourable case for the baseline).

With ``--one-per-node`` the peerstate job runs on 4 simulated nodes of 1 worker
(the spare on node 0), and with ``--parity-group 4`` (which implies it and
``--replicated``) each rank's state is covered by a parity group of the 4
instead of a buddy: the replacement pulls it from the 3 pieces the survivors
rebuilt (``Job(parity_group=4)``). Run ``--replicated --one-per-node`` beside it
for buddies on the same nodes. ``--parity-group 8`` runs 8 workers (8 nodes of
1), and so does the baseline; ``--workers 8`` sets that for buddies.

With ``--etcd`` each run also recovers the same job with its control plane in a
3-member etcd cluster on loopback (``--store etcd://``) instead of node 0's
TCPStore: the ``etcd_s`` column, and the ratio of the two in the same run.

Run: python bench/recovery.py [--quick] [--state-mib 256] [--repeat 3] [--data-parallel-shares N] [--etcd]
[--replicated [--one-per-node [--workers N]]] [--parity-group G]
Writes bench/results/recovery.json (recovery_replicated.json with --replicated,
recovery_replicated_one_per_node.json, recovery_parity{G}.json; with _workers{N}
and _{S}mib before .json for other worker counts and state sizes than 4 and 256;
recovery_shares{N}.json with --data-parallel-shares N, recovery_etcd.json with
--etcd): rows with phase, ours_s, baseline_s, speedup (and etcd_s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from peerstate.tools.etcd_cluster import EtcdCluster
from peerstate.tools.local import LocalJob, kill_all, start_plain_workers, wait_until

HERE = Path(__file__).resolve().parent
JOB = HERE / "recovery_job.py"
RESULTS = HERE / "results" / "recovery.json"
OUR_PHASES = ("detect", "plan", "abort", "re-form", "transfer", "restore", "first step")
BASELINE_PHASES = ("detect", "stop", "restart", "load", "first step")
KEEP_LOGS_OVER_S = 5.0  # a recovery this slow keeps its folder


def peerstate_recovery(work: Path, state_mib: int, steps: int, kill_step: int, timeout: float,
                       replicated: bool, shares: Optional[int], etcd: Optional[str] = None,
                       one_per_node: bool = False, parity_group: int = 0, workers: int = 4) -> dict:
    store_args = ["--job-id", f"{work.parent.name}-{work.name}"] if etcd else []  # one per run
    job = LocalJob(work, [(1, 1)] + [(1, 0)] * (workers - 1) if one_per_node else [(2, 1), (2, 0)],
                   [str(JOB), "--mode", "peerstate", "--state-mib", str(state_mib), "--steps", str(steps)]
                   + (["--replicated"] if replicated else [])
                   + (["--parity-group", str(parity_group)] if parity_group else [])
                   + (["--data-parallel-shares", str(shares)] if shares else []),
                   agent_args=["--inject", f"kill:rank=2:step={kill_step}", *store_args], store=etcd)
    try:
        codes = job.wait(timeout)
        if any(codes):
            raise RuntimeError(f"the peerstate job failed ({codes}):\n{job.agent_logs[0].read_text()[-2000:]}")
        [recovery] = job.events("recovery")
        pulled = job.events("pulled")
    finally:
        job.close()
    return {"phases": recovery["phases_s"], "total_s": recovery["total_s"], "from": recovery["from"],
            "chunks_from_memory": sum(p["chunks_from_memory"] for p in pulled),
            "chunks_pulled": sum(p["chunks"] for p in pulled)}


def _times(work: Path, generation: int, pattern: str, workers: int) -> list:
    return [[float(t) for t in re.findall(pattern, (work / f"restart{generation}.rank{rank}.log").read_text(), re.M)]
            for rank in range(workers)]


def restart_recovery(work: Path, state_mib: int, steps: int, kill_step: int, timeout: float,
                     workers: int = 4) -> dict:
    checkpoints = work / "checkpoints"
    checkpoints.mkdir()
    script = [str(JOB), "--mode", "restart", "--state-mib", str(state_mib), "--steps", str(steps),
              "--checkpoint-dir", str(checkpoints)]
    first = start_plain_workers(script, workers, work / "restart0")
    second = []
    try:
        wait_until(lambda: any(int(s) >= kill_step for s in re.findall(
            r"^step (\d+)", (work / "restart0.rank2.log").read_text(), re.M)), f"step {kill_step}", timeout, first,
            interval=0.005)
        killed_at = time.time()
        os.killpg(first[2].pid, signal.SIGKILL)
        while first[2].poll() is None:  # waitpid, as an agent would
            time.sleep(0.001)
        detected_at = time.time()
        kill_all(first)
        stopped_at = time.time()
        second = start_plain_workers(script + ["--resume"], workers, work / "restart1")
        wait_until(lambda: all(t for t in _times(work, 1, r"^step \d+ (\S+)", workers)),
                   "the first step after restart", timeout, second, interval=0.005)
        started = max(t[0] for t in _times(work, 1, r"^started (\S+)", workers))
        loaded = max(t[0] for t in _times(work, 1, r"^loaded (\S+)", workers))
        first_step = max(t[0] for t in _times(work, 1, r"^step \d+ (\S+)", workers))
    finally:
        kill_all(first + second)
    phases = {"detect": detected_at - killed_at, "stop": stopped_at - detected_at, "restart": started - stopped_at,
              "load": loaded - started, "first step": first_step - loaded}
    return {"phases": phases, "total_s": first_step - killed_at}


def run(quick: bool = False, state_mib: int = 256, repeat: int = 0, timeout: float = 300.0,
        replicated: bool = False, shares: Optional[int] = None, etcd: bool = False, one_per_node: bool = False,
        parity_group: int = 0, workers: int = 4) -> list:
    repeat = repeat or (1 if quick else 3)
    steps, kill_step = 60, 25
    ours, baseline, over_etcd = [], [], []
    cluster = EtcdCluster(Path(tempfile.mkdtemp(prefix="peerstate-etcd-")), members=3) if etcd else None
    try:
        for index in range(repeat):
            work = Path(tempfile.mkdtemp(prefix="peerstate-recovery-"))
            (work / "ours").mkdir()
            (work / "base").mkdir()
            ours.append(peerstate_recovery(work / "ours", state_mib, steps, kill_step, timeout, replicated, shares,
                                           one_per_node=one_per_node, parity_group=parity_group,
                                           workers=workers))
            if cluster:
                (work / "etcd").mkdir()
                over_etcd.append(peerstate_recovery(work / "etcd", state_mib, steps, kill_step, timeout, replicated,
                                                    shares, etcd=cluster.url))
            baseline.append(restart_recovery(work / "base", state_mib, steps, kill_step, timeout, workers))
            slowest = max(r["total_s"] for r in (ours[-1], *over_etcd[-1:]))
            if slowest < KEEP_LOGS_OVER_S:
                shutil.rmtree(work)
            else:  # a rare slow recovery: its event log and worker logs are what explains it
                print(f"  run {index + 1}: recovery took {slowest:.1f}s; its logs are kept in {work}")
            memory = (f", {ours[-1]['chunks_from_memory']} of the {ours[-1]['chunks_pulled']} data-parallel chunks "
                      "pulled (by all ranks) read from same-node memory" if ours[-1]["chunks_pulled"] else "")
            with_etcd = f", over etcd {over_etcd[-1]['total_s']:.3f}s" if cluster else ""
            print(f"  run {index + 1}/{repeat}: peerstate {ours[-1]['total_s']:.3f}s{with_etcd}, "
                  f"restart {baseline[-1]['total_s']:.3f}s ({baseline[-1]['total_s'] / ours[-1]['total_s']:.1f}x)"
                  f"{memory}", flush=True)
    finally:
        if cluster:
            cluster.close()
            shutil.rmtree(cluster.directory, ignore_errors=True)
    median = statistics.median
    rows = [{"phase": p, "ours_s": median(r["phases"][p] for r in ours), "baseline_s": None, "speedup": None}
            for p in OUR_PHASES]
    if over_etcd:
        for row in rows:
            row["etcd_s"] = median(r["phases"][row["phase"]] for r in over_etcd)
    rows += [{"phase": f"baseline {p}", "ours_s": None, "baseline_s": median(r["phases"][p] for r in baseline),
              "speedup": None} for p in BASELINE_PHASES]
    ours_total = median(r["total_s"] for r in ours)
    base_total = median(r["total_s"] for r in baseline)
    rows.append({"phase": "kill to first step", "ours_s": ours_total, "baseline_s": base_total,
                 "speedup": base_total / ours_total})
    if over_etcd:
        etcd_total = median(r["total_s"] for r in over_etcd)
        rows[-1].update(etcd_s=etcd_total, etcd_speedup=base_total / etcd_total,
                        etcd_vs_tcpstore=etcd_total / ours_total)
    for row in rows:
        row.update(state_mib=state_mib, workers=workers, spares=1, runs=repeat,
                   data_parallel_shares=shares or 2,  # the Job's default here: one per worker of a node
                   state_from=(f"parity groups of {parity_group}" if parity_group else "buddies (replicated)"
                               if replicated else "surviving ranks (data_parallel)"),
                   nodes=f"{workers} x 1" if one_per_node else "2 x 2")
    rows.append({"phase": "each run", "runs": [
        {"ours_s": o["total_s"], "baseline_s": b["total_s"], "speedup": b["total_s"] / o["total_s"],
         "chunks_from_memory": o["chunks_from_memory"], "chunks_pulled": o["chunks_pulled"],
         **({"etcd_s": e["total_s"]} if e else {})}
        for o, b, e in zip(ours, baseline, over_etcd or [None] * len(ours))]})
    return rows


def print_table(rows: list) -> None:
    etcd = any("etcd_s" in row for row in rows)
    print(f"{'phase':<28}{'peerstate s':>13}" + (f"{'over etcd s':>13}" if etcd else "")
          + f"{'restart s':>12}{'speedup':>10}" + (f"{'etcd/tcp':>10}" if etcd else ""))
    for row in rows:
        if "runs" in row and "ours_s" not in row:
            continue  # the per-run figures, printed as they came
        cells = [f"{row[k]:.3f}" if row.get(k) is not None else "" for k in ("ours_s", "etcd_s", "baseline_s")]
        speedup = f"{row['speedup']:.1f}x" if row["speedup"] else ""
        ratio = f"{row['etcd_vs_tcpstore']:.2f}" if row.get("etcd_vs_tcpstore") else ""
        print(f"{row['phase']:<28}{cells[0]:>13}" + (f"{cells[1]:>13}" if etcd else "")
              + f"{cells[2]:>12}{speedup:>10}" + (f"{ratio:>10}" if etcd else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of each (under two minutes)")
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=0, help="runs of each (default 3, 1 with --quick)")
    parser.add_argument("--replicated", action="store_true",
                        help="the replacement pulls all its state from its buddy (default: track(data_parallel="
                             "True), the model state comes from the surviving ranks' own snapshots)")
    parser.add_argument("--data-parallel-shares", type=int, default=None,
                        help="Job(data_parallel_shares=N) (default: 2, one per worker of a node; 1: a full copy per "
                             "rank); writes recovery_shares{N}.json")
    parser.add_argument("--one-per-node", action="store_true", help="4 simulated nodes of 1 worker (2 x 2 by default)")
    parser.add_argument("--parity-group", type=int, default=0,
                        help="Job(parity_group=G): implies --replicated and --one-per-node; writes recovery_parity{G}.json")
    parser.add_argument("--workers", type=int, default=4,
                        help="with --one-per-node: this many nodes of 1 worker (default 4; --parity-group G: G)")
    parser.add_argument("--etcd", action="store_true",
                        help="also recover with the control plane in a 3-member etcd cluster on loopback (needs the "
                             "etcd binary); writes recovery_etcd.json")
    args = parser.parse_args()
    if args.parity_group:
        args.replicated = args.one_per_node = True
        args.workers = max(args.workers, args.parity_group)
    if args.workers != 4 and not args.one_per_node:
        parser.error("--workers needs --one-per-node (or --parity-group)")
    source = (f"its parity group of {args.parity_group}" if args.parity_group else
              "its buddy" if args.replicated else "the surviving ranks (data_parallel)")
    print(f"recovery of {args.workers} workers + 1 spare on "
          f"{f'{args.workers} nodes of 1' if args.one_per_node else '2 nodes of 2'}, "
          f"{args.state_mib} MiB of state per rank, kill -9 of rank 2, state from {source}")
    rows = run(args.quick, args.state_mib, args.repeat, replicated=args.replicated, shares=args.data_parallel_shares,
               etcd=args.etcd, one_per_node=args.one_per_node, parity_group=args.parity_group, workers=args.workers)
    print_table(rows)
    path = (RESULTS.with_name("recovery_etcd.json") if args.etcd else
            RESULTS.with_name(f"recovery_parity{args.parity_group}.json") if args.parity_group else
            RESULTS.with_name("recovery_replicated_one_per_node.json") if args.replicated and args.one_per_node else
            RESULTS.with_name("recovery_replicated.json") if args.replicated else
            RESULTS.with_name(f"recovery_shares{args.data_parallel_shares}.json") if args.data_parallel_shares else
            RESULTS)
    suffix = (f"_workers{args.workers}" if args.workers != 4 and not args.parity_group else "") + \
        (f"_{args.state_mib}mib" if args.state_mib != 256 else "")
    path = path.with_name(f"{path.stem}{suffix}.json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"benchmark": "recovery", "time": time.time(), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

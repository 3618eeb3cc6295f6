"""Soak: recovery under a stream of faults of every kind, and what survives it.

A CPU job of the demo's GPT (``bench/soak_job.py``: 4 workers on 2 simulated
nodes with 2 hot spares each, refilled; DDP, its state in data-parallel
shares; a disk checkpoint every ``--checkpoint-every`` steps; the store a
3-member etcd on loopback, so that either node can be lost) runs in rounds
until ``--faults`` faults have landed. A round is one ``peerstate run`` job on
the same ``--checkpoint-dir``, so it goes on where the last one stopped (a lost
node does not come back within a job, so a round loses at most one); its
faults are ``--inject random:...`` over every kind (a worker killed, a hang, a
node killed, a spare killed, a kill inside a recovery, a hang then a kill of
its buddy, a rank and its buddy killed at once), drawn from ``--seed`` and the
round's number. Then a fault-free run of the same steps is compared bit for
bit with the last round's final parameters.

Reported, per fault (a sequence of two counts as one):
- recovered, fallen back to the disk checkpoint, or lost. A fallback is
  expected where the recovery lost every copy of some state (a rank and its
  buddy, by this fault or one that landed on top of it); anywhere else it is
  a finding (``unexpected``). Where one of the pair was hung rather than gone,
  its memory still held the copy: its agent keeps it stopped for its
  replacement to read (``launcher.stopped_workers``), so a fallback then is
  unexpected too, unless the agent killed it at once (it had no rank yet),
  which is listed apart and not failed on;
- from its first fault to the first step after the recovery that ended it:
  p50, p99, max, and every one over 2 s and over 5 s with its slowest phase
  and its plan's reason;
- recoveries no injected fault explains (a node declared lost that was not);
- each worker's resident memory, sampled after each recovery and every
  ``MEMORY_SAMPLE_SECONDS``, and its growth over its life (a leak grows), from
  its first sample and, across recoveries, from its first sample
  ``WARM_UP_SECONDS`` after that one to its last, where a recovery ended
  between the two (what a starting worker settles into is not a leak:
  ``bench/memory_drift.py``), leaving out the first sample after each
  recovery (a survivor still rebuilding what its abort released);
- processes left behind after each round; the final parameters against the
  fault-free run's;
- where an epoch stalled (no member joined it 4 s after its plan: with its
  detection, a recovery over 5 s), every worker's and spare's stacks, in
  its log (``dump_stalled``).

Measured: all of it, on this machine's 2 cores. Each step sleeps up to
``--step-seconds`` (0.1 s), standing in for compute, so that a round's length
is known in steps; the reference runs unpaced (the pacing changes no value).

    python bench/soak.py              # >= 100 faults: 31 min of rounds, 15 min of reference; results/soak.json
    python bench/soak.py --quick      # >= 10 faults in one round, mtbf 5 s, the GPT 64 wide of 1 layer
                                      # (tests/e2e/test_soak.py runs it)
    python bench/soak.py --keep DIR --reanalyse   # a kept soak analysed again from its event logs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

# bench/ is sys.path[0] for `python bench/soak.py`; the tests put it there to load this file
from soak_analysis import KINDS, WARM_UP_SECONDS, analyse, holds, summarise, unexplained

HERE = Path(__file__).resolve().parent
JOB = HERE / "soak_job.py"
RESULTS = HERE / "results" / "soak.json"
NODES = [(2, 2), (2, 2)]  # (workers, spares) per simulated node
WORLD = sum(workers for workers, _ in NODES)
# Detection in about a second: what a recovery is measured from is the fault itself.
AGENT_FLAGS = ["--lease-timeout", "1.0", "--hang-timeout", "1.0", "--spare-timeout", "30", "--join-timeout", "60"]


def buddies() -> Dict[int, int]:
    """rank -> its buddy (k=1), as every process of the job places it (the nodes are equal)."""
    from peerstate.launcher.inject import buddies as placed

    return placed(WORLD, len(NODES))


def fault_spec(args, index: int) -> str:
    """Round ``index``'s ``--inject`` spec: every kind, drawn from the seed and the round."""
    return f"random:mtbf={args.mtbf}:seed={args.seed * 1000 + index}:max={args.per_round}:kinds={KINDS}"


def run_round(index: int, args, etcd, workdir: Path, total_steps: int) -> dict:
    """One job of ``total_steps`` (resuming after the newest checkpoint) with its faults;
    returns what happened, from its event log and the machine."""
    from peerstate.tools.local import LocalJob, resident_bytes

    job = LocalJob(workdir / f"round{index}", NODES,
                   [str(JOB), "--steps", str(total_steps), "--out", str(workdir / "final.pt"),
                    "--step-seconds", str(args.step_seconds), *model_args(args)],
                   agent_args=[*AGENT_FLAGS, "--job-id", f"soak-{args.seed}-{index}", "--checkpoint-dir",
                               str(workdir / "checkpoints"), "--checkpoint-every", str(args.checkpoint_every),
                               "--inject", fault_spec(args, index)], store=etcd.url)
    (workdir / f"round{index}").mkdir(parents=True, exist_ok=True)
    (workdir / f"round{index}" / "round.json").write_text(json.dumps({
        "steps": total_steps, "spec": fault_spec(args, index), "width": args.width, "layers": args.layers}))
    # pid -> [wall time, its resident bytes, recoveries ended so far], after each recovery and
    # every MEMORY_SAMPLE_SECONDS: a worker is measured from soon after it took its rank.
    memory: Dict[int, List[List[float]]] = {}
    seen, sampled = 0, -math.inf
    dumped: set = set()
    try:
        deadline = time.monotonic() + args.round_timeout
        while any(agent.poll() is None for agent in job.agents) and time.monotonic() < deadline:
            events = job.events()
            dump_stalled(job, events, dumped)
            recoveries = sum(e["event"] == "recovery" for e in events)
            if recoveries > seen or time.monotonic() - sampled >= MEMORY_SAMPLE_SECONDS:
                seen, sampled = recoveries, time.monotonic()
                for pid in [pids[-1] for pids in job.rank_pids().values()]:
                    rss = resident_bytes(pid)
                    if rss:
                        memory.setdefault(pid, []).append([time.time(), rss, recoveries])
            time.sleep(0.2)
        codes = [agent.poll() for agent in job.agents]
    finally:
        job.close()
    time.sleep(0.5)  # workers die with their agent (PR_SET_PDEATHSIG): give the kernel a moment
    leftover = job.leftover_processes()
    events = job.events()
    timed_out = f"the round did not end within --round-timeout {args.round_timeout:.0f}s" if None in codes else None
    live = {"codes": codes, "leftover": leftover, "memory": {str(pid): samples for pid, samples in memory.items()}}
    (job.dir / LIVE).write_text(json.dumps(live))  # what a reanalysis cannot read from the event log
    return round_result(index, events, job.dir, spec=fault_spec(args, index), steps=total_steps, codes=codes,
                        leftover=leftover, memory=live["memory"], timed_out=timed_out)


MEMORY_SAMPLE_SECONDS = 2.0
LIVE = "live.json"  # a round's samples of what only a live round can measure (memory, processes left)
STALL_SECONDS = 4.0  # a plan that old whose epoch no member joined: the round dumps every worker's stacks


def dump_stalled(job, events: List[dict], dumped: set) -> None:
    """Once per stalled epoch (``STALL_SECONDS``), have every live worker and spare
    print its threads' stacks to its log (``soak_job.py`` registers SIGUSR2 with
    faulthandler), and say so in the event log: a stall explains itself afterwards."""
    from peerstate.tools.local import alive

    plans = [e for e in events if e["event"] == "plan"]
    if not plans or plans[-1]["epoch"] in dumped or time.time() - plans[-1]["time"] < STALL_SECONDS:
        return
    epoch = plans[-1]["epoch"]
    if any(e["event"] == "joined" and e.get("epoch") == epoch for e in events):
        return
    dumped.add(epoch)
    pids = {e["pid"] for e in events if e["event"] == "spare_ready"}
    pids.update(p for held in job.rank_pids().values() for p in held)
    live = sorted(p for p in pids if alive(p))
    with open(job.logs / "events.jsonl", "a") as log:
        log.write(json.dumps({"time": time.time(), "event": "stacks_dumped", "source": "soak", "epoch": epoch,
                              "pids": live}) + "\n")
    for pid in live:
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass


def round_result(index: int, events: List[dict], folder: Path, *, spec: Optional[str], steps: int,
                 codes: Optional[List[Optional[int]]], leftover: Optional[List[int]],
                 memory: Dict[str, List[int]], timed_out: Optional[str] = None) -> dict:
    """A round as the summary reads it: what was sampled live, and the analysis of its
    event log (the reason the job stopped, if it did: its own, else ``timed_out``)."""
    return {"round": index, "spec": spec, "steps": steps, "codes": codes, "leftover": leftover, "memory": memory,
            "faults": analyse(events, buddies()), "unexplained": unexplained(events), "log": str(folder),
            "failure": next((e.get("reason") for e in events if e["event"] == "job_failed"), timed_out)}


def reread_rounds(workdir: Path) -> tuple:
    """(rounds, total steps) of a soak kept in ``workdir`` (``--keep``), from each round's
    event log: what ``run_round`` returns, with what it sampled live (workers' memory,
    processes left behind, the agents' exit codes) from its ``LIVE`` file where it kept
    one (else None: not measured)."""
    from peerstate.control.timeline import read_events

    rounds, steps = [], 0
    while (workdir / f"round{len(rounds)}" / "logs" / "events.jsonl").exists():
        folder = workdir / f"round{len(rounds)}"
        events = read_events(str(folder / "logs" / "events.jsonl"))
        kept = folder / "round.json"
        spec = None
        if kept.exists():
            recorded = json.loads(kept.read_text())
            steps, spec = recorded["steps"], recorded["spec"]
        else:  # a soak from before round.json: its last step, from rank 0's output
            done = re.findall(r"^rank 0 step (\d+)", "".join(
                p.read_text(errors="replace") for p in (folder / "logs").glob("n*.log")), re.M)
            steps = max(map(int, done)) + 1
        live = json.loads((folder / LIVE).read_text()) if (folder / LIVE).exists() else {}
        rounds.append(round_result(len(rounds), events, folder, spec=spec, steps=steps, codes=live.get("codes"),
                                   leftover=live.get("leftover"), memory=live.get("memory", {})))
    return rounds, steps


# The unpaced reference makes about 10 steps a second here; a full soak's is thousands of steps.
REFERENCE_SECONDS_PER_STEP = 0.25


def model_args(args) -> List[str]:
    """The model's flags for ``soak_job.py``: the round's and the reference's are the same."""
    return ["--width", str(args.width), "--layers", str(args.layers)]


def reference_run(workdir: Path, steps: int, model: List[str], timeout: float) -> Path:
    """The same steps of the same ``model`` without a fault (one node of 4, unpaced): its final
    parameters. ``timeout`` grows with ``steps`` (REFERENCE_SECONDS_PER_STEP)."""
    timeout = max(timeout, steps * REFERENCE_SECONDS_PER_STEP)
    from peerstate.tools.local import LocalJob

    out = workdir / "reference.pt"
    made = workdir / "reference.json"  # the steps it was run for: a reanalysis reuses it
    if out.exists() and made.exists() and json.loads(made.read_text()) == {"steps": steps, "model": model}:
        return out
    shutil.rmtree(workdir / "reference", ignore_errors=True)
    job = LocalJob(workdir / "reference", [(WORLD, 0)], [str(JOB), "--steps", str(steps), "--out", str(out),
                                                          "--step-seconds", "0", *model])
    try:
        if job.wait(timeout) != [0]:
            raise RuntimeError(f"the fault-free reference failed; see {job.dir}")
    finally:
        job.close()
    made.write_text(json.dumps({"steps": steps, "model": model}))
    return out


def bitwise(reference: Path, final: Path) -> dict:
    import torch

    a, b = torch.load(reference), torch.load(final)
    different = [name for name in a if name not in b or not torch.equal(a[name], b[name])]
    return {"equal": not different and a.keys() == b.keys(), "tensors": len(a), "different": different}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of about 10 faults")
    parser.add_argument("--faults", type=int, default=None, help="faults to land in all (default 100; --quick 10)")
    parser.add_argument("--per-round", type=int, default=None, help="faults drawn per round (default 8; --quick 10)")
    parser.add_argument("--mtbf", type=float, default=None,
                        help="mean seconds between faults (default 8; --quick 5: a refilled spare takes 1.5-3 s to "
                             "be ready on these 2 busy cores, forked from the fork server (bench/spare_refill.py), and "
                             "a third of the faults take two ranks, so a shorter one outruns the refill and recoveries "
                             "wait for spares; the quick form checks what survives, not how fast)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--width", type=int, default=None,
                        help="the demo GPT's width (default 128, as the demo's; --quick 64: the test's fault-free "
                             "reference then takes half the time, and the faults land as they do at 128)")
    parser.add_argument("--layers", type=int, default=None, help="its layers (default 2; --quick 1)")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--tail", type=float, default=4.0, help="seconds a round runs past its last fault")
    parser.add_argument("--round-timeout", type=float, default=300.0)
    parser.add_argument("--keep", default=None, help="a folder for the logs (default: a temporary one)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--reanalyse", action="store_true",
                        help="analyse the rounds kept in --keep again, from their event logs and what each round "
                             "sampled live (workers' memory, processes left behind: its live.json, where kept), and "
                             "run the reference")
    args = parser.parse_args(argv)
    # A SIGTERM runs the finally blocks, as Ctrl-C does: the round's job and etcd stop with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    target = args.faults or (10 if args.quick else 100)
    args.per_round = args.per_round or (10 if args.quick else 8)
    args.mtbf = args.mtbf or (5.0 if args.quick else 8.0)
    args.width = args.width or (64 if args.quick else 128)
    args.layers = args.layers or (1 if args.quick else 2)
    from peerstate.tools.etcd_cluster import EtcdCluster
    from peerstate.worker.checkpoint import latest_checkpoint

    workdir = Path(args.keep or tempfile.mkdtemp(prefix="peerstate-soak-"))
    if args.reanalyse:
        return reanalyse(args, workdir, argv)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "etcd").mkdir(exist_ok=True)
    etcd = EtcdCluster(workdir / "etcd", members=3)
    rounds: List[dict] = []
    total_steps = 0
    started = time.monotonic()
    try:
        while sum(len(r["faults"]) for r in rounds) < target:
            from peerstate.launcher.inject import parse

            spec_faults = parse(fault_spec(args, len(rounds)), world_size=WORLD, nnodes=len(NODES))
            if rounds and rounds[-1]["failure"]:  # it stopped short: the next goes on from its newest checkpoint
                newest = latest_checkpoint(str(workdir / "checkpoints"))
                total_steps = newest[0] + 1 if newest else 0
            total_steps += math.ceil((max(f.time for f in spec_faults) + args.tail) / args.step_seconds)
            result = run_round(len(rounds), args, etcd, workdir, total_steps)
            rounds.append(result)
            faults = result["faults"]
            print(f"round {result['round']}: {len(faults)} faults landed, "
                  f"{sum(f['outcome'] == 'recovered' for f in faults)} recovered, "
                  f"{sum(f['outcome'] == 'checkpoint' for f in faults)} from the checkpoint, "
                  f"{sum(f['outcome'] == 'lost' for f in faults)} lost; agents exited {result['codes']}"
                  + (f"; the job stopped: {result['failure']}" if result["failure"] else ""), flush=True)
            if result["failure"] and not faults:
                print("the soak stops: a round stopped before any fault landed, and the next would start from the "
                      "same place", flush=True)  # finish() reports the round as failed
                break
    finally:
        etcd.close()
    return finish(args, argv, workdir, rounds, total_steps, started)


def reanalyse(args, workdir: Path, argv) -> int:
    if not args.keep:
        raise SystemExit("--reanalyse needs --keep DIR, the folder of the soak to analyse again")
    rounds, total_steps = reread_rounds(workdir)
    if not rounds:
        raise SystemExit(f"no rounds in {workdir} (round0/logs/events.jsonl)")
    kept = workdir / "round0" / "round.json"
    recorded = json.loads(kept.read_text()) if kept.exists() else {}
    # the model the rounds trained (a soak from before it was recorded: the demo's, the only one then)
    args.width, args.layers = recorded.get("width", 128), recorded.get("layers", 2)
    return finish(args, argv, workdir, rounds, total_steps, time.monotonic())


def finish(args, argv, workdir: Path, rounds: List[dict], total_steps: int, started: float) -> int:
    """The fault-free reference, the bitwise check, the summary and its report."""
    check = bitwise(reference_run(workdir, total_steps, model_args(args), args.round_timeout), workdir / "final.pt")
    summary = summarise(rounds, check)
    report(summary, rounds, time.monotonic() - started)
    result = {"benchmark": "soak", "command": " ".join(["python", "bench/soak.py", *(argv or sys.argv[1:])]),
              "seed": args.seed, "mtbf_s": args.mtbf, "steps": total_steps, "width": args.width, "layers": args.layers,
              "summary": summary, "rounds": rounds}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}; logs in {workdir}")
    return 0 if holds(summary) else 1


def report(summary: dict, rounds: List[dict], seconds: float) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.3f}s"  # noqa: E731
    print(f"\n{summary['faults']} faults in {len(rounds)} rounds, {seconds / 60:.1f} min "
          f"(by kind: {summary['by_kind']})")
    print(f"{'outcome':<24}{'faults':>8}")
    for outcome, count in sorted(summary["outcomes"].items()):
        print(f"{outcome:<24}{count:>8}")
    print(f"fault to first step: p50 {fmt(summary['p50_s'])}, p99 {fmt(summary['p99_s'])}, "
          f"max {fmt(summary['max_s'])}")
    for label in ("over_2s", "over_5s"):
        for f in summary[label]:
            print(f"  {label}: {f['kind']} of ranks {f['victims']}: {f['seconds']:.2f}s, slowest phase "
                  f"{f.get('slowest_phase')} ({f.get('reason')})")
    for f in summary["unexpected_fallbacks"]:
        print(f"  fell back to the checkpoint though a copy survived: {f['kind']} of ranks {f['victims']}")
    for f in summary["no_copy_yet_fallbacks"]:
        print(f"  fell back to the checkpoint within a step of the recovery before it, its rank with no copy on a "
              f"holder yet: {f['kind']} of ranks {f['victims']}")
    for f in summary["hung_copy_fallbacks"]:
        print(f"  fell back to the checkpoint: one of the pair was hung, and killed at once (it had no index): "
              f"{f['kind']} of ranks {f['victims']}")
    for f in summary["lost"]:
        print(f"  LOST: {f['kind']} of ranks {f['victims']}")
    for reason in summary["unexplained_recoveries"]:
        print(f"  a recovery no fault explains: {reason}")
    growth, settled = summary["memory_growth_max"], summary["memory_growth_after_warm_up_max"]
    print(f"workers' memory growth over their recoveries: max {'-' if growth is None else f'{growth:+.1%}'} "
          f"from their first sample ({summary['workers_measured']} workers), "
          f"{'-' if settled is None else f'{settled:+.1%}'} after their warm-up "
          f"({summary['workers_measured_after_warm_up']} workers sampled twice {WARM_UP_SECONDS:g} s or more after "
          f"their first sample, a recovery between); processes left behind: {summary['leftover_processes']}")
    for failed in summary["failed_rounds"]:
        print(f"  round {failed['round']} stopped: {failed['reason']} (logs: {failed['log']})")
    print(f"final parameters bitwise equal to the fault-free run: {summary['bitwise']['equal']} "
          f"({summary['bitwise']['tensors']} tensors)")


if __name__ == "__main__":
    sys.exit(main())

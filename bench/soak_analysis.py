"""The soak's analysis (``bench/soak.py``): what each injected fault came to, from a
round's event log, and the summary a soak is judged by (``holds``). Pure functions of
the events and what a round sampled live; tested by tests/e2e/test_soak.py on event
logs cut from real rounds."""

from __future__ import annotations

import math
from typing import Dict, List, Optional

KINDS = "kill,hang,kill-node,kill-spare,kill-in-recovery,hang-then-kill-buddy,kill-with-buddy"

# A worker's warm-up: bench/memory_drift.py, the soak's job with no fault, grows 7-9% in the
# first ~12 s after its first sample and ~2% in the minute after (allocator and torch caches
# filling). Growth is also reported from the first sample a worker gave at least this long
# after its first: what recoveries add, not what a starting worker settles into.
WARM_UP_SECONDS = 12.0

# A fault this soon after the last recovery's first step is in its window: the ranks' first
# copies since it may not all have reached their holders (ten of the soak's paced steps).
WINDOW_SECONDS = 1.0


def analyse(events: List[dict], buddy: Dict[int, int]) -> List[dict]:
    """Each fault that landed: its kind, victims, outcome, and the time from its first
    part to the first step after the recovery that ended it.

    A part's recovery begins with the first plan detected after it lands that replaces
    its rank (for a lost node, any plan): ``plan`` events. The fault ends with the first
    recovery to complete (``recovery`` events, after every member's first step) of an
    epoch at or past its parts' (a recovery interrupted by a second failure completes
    as the next epoch's)."""
    plans = sorted((e["detected_at"], e["epoch"], set(e["failed"])) for e in events if e["event"] == "plan")
    completed = sorted((e["epoch"], max(m.get("first step", 0.0) for m in e["marks"].values()), e)
                       for e in events if e["event"] == "recovery" and e.get("marks"))
    fallbacks = {e["epoch"] for e in events if e["event"] == "checkpoint_fallback"}
    # A rank's first copy goes to its buddy a step after a recovery (docs/recovery.md: "a second failure of
    # their ranks within that window is a loss"); after a fallback, that is from the checkpoint again.
    no_copy_yet = {e["epoch"] for e in events if e["event"] == "checkpoint_fallback"
                   and "no committed copy on any holder yet" in e.get("message", "")}
    # The same window seen from the holders: some ranks' first copies landed, others' not.
    mixed = {e["epoch"] for e in events if e["event"] == "checkpoint_fallback"
             and "the copies are of different steps" in e.get("message", "")}
    losses = {e["epoch"] for e in events if e["event"] == "state_lost"}
    stopped = [e["time"] for e in events if e["event"] == "job_failed"]
    spares_started = [e["time"] for e in events if e["event"] == "spare_started"]
    hung = [(e["time"], e["rank"], e["worker"]) for e in events
            if e["event"] == "process_exited" and "hung" in e.get("how", "")]
    frozen = {e["worker"] for e in events if e["event"] == "hung_worker_frozen"}
    landed: Dict[int, List[dict]] = {}
    for event in events:
        if event["event"] == "fault_injected" and "scenario" in event:
            landed.setdefault(event["scenario"], []).append(event)
    faults = []
    for scenario, parts in sorted(landed.items()):
        start = min(e["time"] for e in parts)
        kind = parts[0]["scenario_kind"]
        victims = sorted({e["rank"] for e in parts if e.get("rank") is not None})
        fault = {"scenario": scenario, "kind": kind, "victims": victims, "landed": len(parts),
                 "every_copy_taken": False, "hung_copy": False, "frozen_copy": False, "seconds": None,
                 "outcome": None}
        faults.append(fault)
        if kind == "kill-spare":  # no rank is lost: the pool is refilled, and nothing else happens
            fault["outcome"] = "spare replaced" if any(t > start for t in spares_started) else "spare not replaced"
            continue
        epochs = [next((epoch for detected, epoch, failed in plans if detected >= part["time"] - 1e-3
                        and (part.get("rank") is None or part["rank"] in failed)), None) for part in parts]
        if None in epochs:
            fault["outcome"] = "stopped" if any(t >= start for t in stopped) else "no recovery followed"
            continue
        first, last = min(epochs), max(epochs)
        ended = next(((epoch, end, e) for epoch, end, e in completed if epoch >= last), None)
        through = range(first, (ended[0] if ended else max(losses | fallbacks | {last})) + 1)
        # Every rank lost in the recovery that ended this fault, by this fault or by another in
        # flight with it (landed before or after, its recovery not complete): a rank and its
        # buddy among them took every copy of its state.
        settled = max((epoch for epoch, _, _ in completed if epoch < first), default=0)
        lost = {rank for _, epoch, failed in plans if settled < epoch <= through[-1] for rank in failed}
        pairs = {frozenset((rank, buddy[rank])) for rank in lost if buddy[rank] in lost}
        fault["every_copy_taken"] = bool(pairs)
        until = ended[1] if ended else math.inf  # one of them was hung, not gone, until the agent killed it
        last_hung = {rank: worker for t, rank, worker in hung if start <= t <= until}
        # Each pair is judged apart: a fallback is expected while any pair lost every copy, and a
        # pair did not when the last hung worker of one of its ranks (an earlier one may have been
        # read by the replacement that hung after it) was kept for its replacement to read. A
        # frozen copy of one pair says nothing of another pair killed with it in the same recovery.
        fault["hung_copy"] = bool(pairs) and all(any(rank in last_hung for rank in pair) for pair in pairs)
        fault["frozen_copy"] = bool(pairs) and all(any(last_hung.get(rank) in frozen for rank in pair)
                                                   for pair in pairs)
        if any(epoch in losses for epoch in through) or ended is None:
            fault["outcome"] = "lost" if any(epoch in losses for epoch in through) else "stopped"
            continue
        epoch, end, recovery = ended
        fault["outcome"] = "checkpoint" if any(e in fallbacks for e in through) else "recovered"
        since_last = start - max((at for done, at, _ in completed if done < first), default=-math.inf)
        # A later part that landed while the recovery of an earlier one was in flight (before its
        # first step): that recovery's abort cut the pushes in flight, and the replacement holds
        # only the recovery point, so the holders may hold mixed steps. The same window.
        in_recovery = any(part["time"] > start and not any(start < at < part["time"] for _, at, _ in completed)
                          for part in parts)
        fault["no_copy_yet"] = any(e in no_copy_yet or (e in mixed and (since_last < WINDOW_SECONDS or in_recovery))
                                   for e in through)
        fault["seconds"] = end - start
        phases = {k: v for k, v in recovery["phases_s"].items() if v is not None}
        fault["slowest_phase"] = max(phases, key=phases.get) if phases else None
        fault["reason"] = recovery.get("reason")
    return faults


def unexplained(events: List[dict], within: float = 5.0) -> List[str]:
    """Failures the agents detected that no injected fault explains (none landed in the
    ``within`` seconds before): a live node declared lost, a worker that left its call too
    late (the abort deadline), a crash. Their reasons."""
    faults = [e["time"] for e in events if e["event"] == "fault_injected"]
    return [e["reason"] for e in events if e["event"] == "failure_detected"
            and not any(0 <= e["detected_at"] - t <= within for t in faults)]


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def summarise(rounds: List[dict], check: dict) -> dict:
    faults = [f for r in rounds for f in r["faults"]]
    seconds = [f["seconds"] for f in faults if f["seconds"] is not None]
    growth, settled = [], []
    for r in rounds:
        for samples in r["memory"].values():
            if len(samples) >= 2:
                growth.append(samples[-1][1] / samples[0][1] - 1)
            # Across recoveries: a recovery ended between the two samples it is measured from. Not
            # from a sample just after a recovery (the first with its count): a survivor is then
            # part way through rebuilding what the abort released (3-5% below its level for a
            # moment, as the soak of 2026-12-03 showed), which reads as growth at the next sample.
            after = [(rss, recoveries) for (t, rss, recoveries), before in zip(samples, [None, *samples])
                     if t >= samples[0][0] + WARM_UP_SECONDS and (before is None or recoveries == before[2])]
            if len(after) >= 2 and after[-1][1] > after[0][1]:
                settled.append(after[-1][0] / after[0][0] - 1)
    by_outcome: Dict[str, int] = {}
    for fault in faults:
        by_outcome[fault["outcome"]] = by_outcome.get(fault["outcome"], 0) + 1
    return {
        "faults": len(faults), "by_kind": {k: sum(f["kind"] == k for f in faults) for k in KINDS.split(",")},
        "outcomes": by_outcome,
        # A copy survived: no pair was lost, or one of it was hung and kept for its replacement to read.
        "unexpected_fallbacks": [f for f in faults if f["outcome"] == "checkpoint" and (
            f.get("frozen_copy") or (not f["every_copy_taken"] and not f.get("no_copy_yet")))],
        # A failure within a step of the recovery before it: its rank had no copy on a holder yet.
        "no_copy_yet_fallbacks": [f for f in faults if f["outcome"] == "checkpoint" and not f["every_copy_taken"]
                                  and f.get("no_copy_yet")],
        # One of the pair was hung, and killed at once (it had no index: no rank yet).
        "hung_copy_fallbacks": [f for f in faults if f["outcome"] == "checkpoint" and f["hung_copy"]
                                and not f.get("frozen_copy")],
        "lost": [f for f in faults if f["outcome"] == "lost"],
        "p50_s": percentile(seconds, 0.5), "p99_s": percentile(seconds, 0.99), "max_s": max(seconds, default=None),
        "over_2s": [f for f in faults if (f["seconds"] or 0) > 2],
        "over_5s": [f for f in faults if (f["seconds"] or 0) > 5],
        "unexplained_recoveries": [reason for r in rounds for reason in r["unexplained"]],
        # From each worker's first sample (after the recovery it joined or first lived through),
        # which includes its warm-up; and from its first sample WARM_UP_SECONDS after that one.
        "memory_growth_max": max(growth, default=None), "workers_measured": len(growth),
        "memory_growth_after_warm_up_max": max(settled, default=None), "workers_measured_after_warm_up": len(settled),
        # None: not measured (a reanalysis of kept logs; they were counted live)
        "leftover_processes": None if any(r["leftover"] is None for r in rounds) else
        sum(len(r["leftover"]) for r in rounds),
        "failed_rounds": [{"round": r["round"], "reason": r["failure"], "log": r["log"]} for r in rounds
                          if r["failure"]],
        "bitwise": check,
    }


def holds(summary: dict) -> bool:
    """What the soak asserts: every fault recovered, or back from the checkpoint where it
    took every copy; nothing lost; no round stopped; no process left (where counted); bitwise."""
    return (not summary["lost"] and not summary["unexpected_fallbacks"] and not summary["failed_rounds"]
            and summary["leftover_processes"] in (0, None) and summary["bitwise"]["equal"]
            and set(summary["outcomes"]) <= {"recovered", "checkpoint", "spare replaced", "no recovery followed"})

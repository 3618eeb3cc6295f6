"""What the step boundary costs, part by part (``bench/overhead.py --breakdown``).

Inside the job (``overhead_job.py --breakdown``): the boundary's calls on the
training thread are wrapped with wall-clock timers (inclusive: a part's own
parts are in it too; a wrapper costs about a microsecond a call, in both modes),
and each step reads the CPU time of the training thread (``time.thread_time``)
and of each other thread (/proc/self/task/TID/schedstat, nanoseconds), grouped by the names
the core gives its threads (``common/thread_name.h``) and Python's thread names.
Rank 0 prints one
``parts STEP MODE {json}`` line a step and, at the end, the limit: one thread's
copy of the bytes a step snapshots, timed in the same process.

In ``bench/overhead.py``: means per step over the on- and the off-steps (not
medians: most parts take 0 in most steps, and CPU times come in clock ticks).
"""

from __future__ import annotations

import collections
import functools
import importlib
import json
import os
import re
import statistics
import threading
import time
from typing import Dict, List, Tuple

# (label, depth, module, class, method): the boundary's calls in the order they run.
PARTS: List[Tuple[str, int, str, str, str]] = [
    ("Job.guard (checks before the step)", 0, "peerstate.worker.job", "Job", "guard"),
    ("StepGuard exit (the boundary)", 0, "peerstate.worker.step_guard", "StepGuard", "__exit__"),
    ("StepBoundary.end_step", 1, "peerstate.worker.step_boundary", "StepBoundary", "end_step"),
    ("ProgressCounter.set_step", 2, "peerstate.control.progress", "ProgressCounter", "set_step"),
    ("Replication.reached", 2, "peerstate.replication.endpoint", "Replication", "reached"),
    ("SnapshotStore.snapshot", 2, "peerstate.state.snapshot", "SnapshotStore", "snapshot"),
    ("pre-snapshot hook (older round in flight?)", 3, "peerstate.replication.endpoint", "Replication",
     "_wait_before_snapshot"),
    ("_write_objects (pickled objects, RNG)", 3, "peerstate.state.snapshot", "SnapshotStore", "_write_objects"),
    ("registration checks", 3, "peerstate.state.snapshot", "_CheckBatch", "check"),
    ("DiskCheckpoints.due", 2, "peerstate.worker.checkpoint", "DiskCheckpoints", "due"),
    ("RecoveryReport.end_step", 2, "peerstate.worker.report", "RecoveryReport", "end_step"),
    ("StepChecks.step_ended", 1, "peerstate.worker.step_guard", "StepChecks", "step_ended"),
    ("start_replication (optimizer pre-hook)", 0, "peerstate.worker.step_boundary", "StepBoundary",
     "start_replication"),
    ("SnapshotStore.wait (copy done?)", 1, "peerstate.state.snapshot", "SnapshotStore", "wait"),
    ("Replication.wait (last round landed?)", 1, "peerstate.replication.endpoint", "Replication", "wait"),
    ("Replication.replicate (push starts)", 1, "peerstate.replication.endpoint", "Replication", "replicate"),
]
# CPU a step, by thread: the training thread, each of the core's named threads
# (common/thread_name.h), the process's other live threads (Python's, gloo's,
# torch's), and threads that ended within the step (a replication round's senders).
THREADS = ["CPU: training thread", "CPU: ps-copy (snapshot copy + CRC)", "CPU: ps-serve (holding buddies' pushes)",
           "CPU: ps-push/ps-link (pushes; ended threads)", "CPU: ps-liveness", "CPU: other threads (gloo, torch)"]
_GROUPS = {"ps-copy": THREADS[1], "ps-serve": THREADS[2], "ps-accept": THREADS[2], "ps-push": THREADS[3],
           "ps-link": THREADS[3], "ps-liveness": THREADS[4]}


def _thread_cpu() -> Dict[int, Tuple[str, float]]:
    """tid -> (name, CPU seconds) of this process's live threads (schedstat's
    nanoseconds on a CPU)."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm, open(f"/proc/self/task/{tid}/schedstat") as stat:
                threads[int(tid)] = (comm.read().strip(), int(stat.read().split()[0]) / 1e9)
        except OSError:  # ended meanwhile
            continue
    return threads


class Instrumented:
    """Timers on ``PARTS`` (training thread only) and the per-step CPU split."""

    def __init__(self) -> None:
        self.totals: Dict[str, float] = collections.defaultdict(float)
        main = threading.main_thread()
        for label, _, module, cls, method in PARTS:
            owner = getattr(importlib.import_module(module), cls)
            original = getattr(owner, method)

            def timed(*args, _original=original, _label=label, **kwargs):
                if threading.current_thread() is not main:
                    return _original(*args, **kwargs)
                started, cpu = time.perf_counter(), time.thread_time()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.totals[_label] += time.perf_counter() - started
                    self.totals[_label + " [cpu]"] += time.thread_time() - cpu

            setattr(owner, method, functools.wraps(original)(timed))
        self._main = threading.get_native_id()
        self._cpu = (time.thread_time(), time.process_time(), _thread_cpu())

    def step(self) -> Dict[str, float]:
        """The parts' seconds since the last call, and the CPU by thread group."""
        thread, process, threads = time.thread_time(), time.process_time(), _thread_cpu()
        python = {t.native_id: t.name for t in threading.enumerate()}
        parts = dict(self.totals)
        for label in THREADS:
            parts[label] = 0.0
        parts[THREADS[0]] = thread - self._cpu[0]
        live = 0.0
        for tid, (name, cpu) in threads.items():
            if tid == self._main:
                continue
            before = self._cpu[2].get(tid)
            used = cpu - (before[1] if before else 0.0)
            live += used
            label = _GROUPS.get(name) or (f"CPU: python thread {python[tid]}" if tid in python else THREADS[-1])
            parts[label] = parts.get(label, 0.0) + used
        # Threads that ended since the last call: what the process used beyond its live threads.
        parts[THREADS[3]] += max(0.0, (process - self._cpu[1]) - parts[THREADS[0]] - live)
        self._cpu = (thread, process, threads)
        self.totals.clear()
        return parts


def copy_limit(nbytes: int, repeats: int = 21) -> float:
    """Median seconds of one thread's copy of ``nbytes`` (torch's ``copy_``, warm)."""
    import torch

    source = torch.randint(0, 255, (max(nbytes, 1),), dtype=torch.uint8)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def parse(text: str) -> dict:
    """The job's output -> {"on"|"off": {part: mean seconds a step}, "steps": {...},
    "copy_bytes": N, "copy_s": S}."""
    rows: Dict[str, List[dict]] = {"on": [], "off": []}
    for mode, payload in re.findall(r"^parts \d+ (on|off) (\{.*\})$", text, re.M):
        rows[mode].append(json.loads(payload))
    limit = re.search(r"^copy_limit (\d+) (\S+)$", text, re.M)
    threads = THREADS + sorted({label for steps in rows.values() for r in steps for label in r
                                if label.startswith("CPU: python thread")})
    labels = [p[0] for p in PARTS] + [p[0] + " [cpu]" for p in PARTS] + threads
    means = {mode: {label: statistics.mean(r.get(label, 0.0) for r in steps) for label in labels}
             for mode, steps in rows.items() if steps}
    return {**means, "threads": threads, "steps": {mode: len(steps) for mode, steps in rows.items()},
            "copy_bytes": int(limit.group(1)) if limit else 0, "copy_s": float(limit.group(2)) if limit else 0.0}


def table(breakdown: dict, step_s: float) -> List[str]:
    """The breakdown as printed lines: ms a step with capture on and off, the
    difference, and the difference as a share of a step of ``step_s`` seconds."""
    lines = [f"{'per step, rank 0 (mean)':<50}{'off ms':>9}{'on ms':>9}{'on-off ms':>11}{'% of step':>11}"
             f"{'on-off CPU ms':>15}"]
    depths = {p[0]: p[1] for p in PARTS}
    for label in [p[0] for p in PARTS] + breakdown["threads"]:
        off, on = breakdown["off"][label] * 1e3, breakdown["on"][label] * 1e3
        cpu = ""
        if label in depths:
            cpu = f"{(breakdown['on'][label + ' [cpu]'] - breakdown['off'][label + ' [cpu]']) * 1e3:>+15.3f}"
        name = "  " * depths.get(label, 0) + label
        lines.append(f"{name:<50}{off:>9.3f}{on:>9.3f}{on - off:>+11.3f}{100 * (on - off) / 1e3 / step_s:>+10.2f}%"
                     f"{cpu}")
    limit = breakdown["copy_s"] * 1e3
    lines.append(f"{'limit: one thread copies the step bytes':<50}{'':>9}{limit:>9.3f}{limit:>+11.3f}"
                 f"{100 * breakdown['copy_s'] / step_s:>+10.2f}%   ({breakdown['copy_bytes'] / 1e6:.1f} MB)")
    return lines

"""Goodput per redundancy mode: what a mode's memory and traffic do to a job of a
given size, beside its recovery time (issue #40).

``goodput.py`` asks how peerstate fares against a restart; this asks which of its
modes a job should run. A mode (``RedundancyMode``) brings four figures:
- host memory per rank, in shards (own versions plus what it holds for others),
  and bytes pushed per rank per step, in shards: from the layout code
  (``bench/redundancy.py``'s rows);
- its kill-to-first-step, measured on a small job (``bench/recovery.py``: a buddy
  on another node, parity groups of 4 and of 8 on 4 and 8 nodes);
- the pipeline its version count runs (``StepBoundary``), which says what the
  step waits for.

The job brings its state per accelerator S, the host memory it may spend on
recoveries per accelerator H, the network each accelerator pushes over B, and the
bandwidth of the snapshot's copy C (device to host). Modelled, per mode:
- it fits when memory_x * S <= H; a mode that does not fit leaves the job to
  checkpoint-restart (its goodput is that row's);
- overhead o = o_measured (the capture's cost beside its copy, ``goodput``'s
  input) + what the step waits for of the copy (S / C) and the push
  (pushed_x * S / B), by pipeline: lazy (4+) copies beside the forward and
  backward and pushes over the next step, waiting for what of either outlasts a
  step; eager (3) waits for the copy and for what of the push outlasts a step;
  synced (2) copies beside the forward and pushes once copied, waiting for what
  of both outlasts the forward, taken as a third of the step;
- a failure falls back to the disk when, inside the recovery window, another
  node that the lost rank's copies depend on is lost too: its k buddies' nodes,
  or the g - 1 other members' nodes of its parity group (``exposed_nodes``), or
  a correlated loss (``GoodputInputs.correlated``), as in ``goodput``.
The goodput is then ``goodput.closed_form``'s with those figures. What is not
modelled: the push's contention with the training's own traffic, the copy's with
the step's, a buddy's k = 2 tolerating one of its two buddies lost (counted as
lost: conservative).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from peerstate.tools.goodput import GoodputInputs, closed_form

FORWARD_SHARE = 1.0 / 3.0  # of a step: the window a synced push overlaps (an assumption: backward ~2x forward)


@dataclass(frozen=True)
class RedundancyMode:
    name: str
    memory_x: float       # host memory per rank, in shards
    pushed_x: float       # bytes pushed per rank per step, in shards
    recovery_s: float     # kill to first step, measured on a small job
    versions: int         # own versions: 4+ lazy, 3 eager, 2 synced (StepBoundary)
    exposed_nodes: int    # other nodes whose loss in the window leaves a lost rank with no copy


@dataclass(frozen=True)
class JobShape:
    """A job's figures per accelerator (defaults: assumptions, each sourced here)."""
    name: str = "70B, Adam, 64 GPUs"
    state_gb: float = 17.5          # S: #40's 70B model with Adam on 64 GPUs (~1.1 TB of state)
    host_gb: float = 128.0          # H: half a p5.48xlarge's 2 TiB per GPU (the rest: the training's own)
    network_gb_s: float = 50.0      # B: a p5.48xlarge's 3,200 Gb/s of EFA, per GPU
    copy_gb_s: float = 25.0         # C: device to host, PCIe Gen5 x16 (64 GB/s raw; ~25 achieved, pinned)

    def push_s(self, mode: RedundancyMode) -> float:
        return mode.pushed_x * self.state_gb / self.network_gb_s

    def copy_s(self) -> float:
        return self.state_gb / self.copy_gb_s


# The shapes bench/goodput.py shows: #40's example, and one whose state a buddy's copy cannot hold
# (405B parameters at 16 bytes each with Adam's moments and fp32 masters, 6.5 TB, on 128 GPUs).
SHAPES = (JobShape(), JobShape(name="405B, Adam, 128 GPUs", state_gb=50.6))


def overhead(inputs: GoodputInputs, shape: JobShape, mode: RedundancyMode) -> float:
    """The per-step overhead of ``mode`` (module docstring)."""
    step, copy, push = inputs.step_s, shape.copy_s(), shape.push_s(mode)
    if mode.versions == 2:
        waits = max(0.0, copy + push - FORWARD_SHARE * step)
    elif mode.versions == 3:
        waits = copy + max(0.0, push - step)
    else:
        waits = max(0.0, copy - step) + max(0.0, push - step)
    return inputs.peerstate_overhead + waits / step


def fits(shape: JobShape, mode: RedundancyMode) -> bool:
    return mode.memory_x * shape.state_gb <= shape.host_gb


def mode_row(inputs: GoodputInputs, shape: JobShape, mode: RedundancyMode, accelerators: int) -> dict:
    """One mode at ``accelerators``: its figures and goodput (None: it does not fit,
    and the job runs checkpoint-restart, whose goodput is ``restart``)."""
    o = overhead(inputs, shape, mode)
    data_plane = replace(inputs, peerstate_overhead=o, peerstate_recovery_s=mode.recovery_s, k=mode.exposed_nodes)
    closed = closed_form(data_plane, accelerators)
    return {"shape": shape.name, "mode": mode.name, "accelerators": accelerators,
            "memory_gb": mode.memory_x * shape.state_gb,
            "fits": fits(shape, mode), "pushed_gb": mode.pushed_x * shape.state_gb, "push_s": shape.push_s(mode),
            "overhead": o, "recovery_s": data_plane.recovery_s(accelerators),
            "goodput": closed["peerstate"] if fits(shape, mode) else None, "restart": closed["checkpoint-restart"]}


def modes_from_results(results_dir: Path, size_mib: int = 1024) -> List[RedundancyMode]:
    """The modes the benchmarks measured: memory and traffic from redundancy.json at
    ``size_mib``, kill-to-first-step from recovery_replicated_one_per_node.json (a buddy
    on another node), recovery_parity4.json and recovery_parity8.json (g = 4's where
    g = 8's is missing). Empty when the others are missing."""
    def kill_s(name: str) -> Optional[float]:
        path = results_dir / name
        if not path.exists():
            return None
        return next(r["ours_s"] for r in json.loads(path.read_text())["rows"] if r["phase"] == "kill to first step")

    layout = results_dir / "redundancy.json"
    buddy, parity4 = kill_s("recovery_replicated_one_per_node.json"), kill_s("recovery_parity4.json")
    if not (layout.exists() and buddy and parity4):
        return []
    parity8 = kill_s("recovery_parity8.json") or parity4
    rows = {r["mode"]: r for r in json.loads(layout.read_text())["rows"] if r["size_mib"] == size_mib}
    modes = []
    for label, row, recovery, exposed in (("buddies k=1", rows["buddies k=1"], buddy, 1),
                                          ("parity g=4", rows["parity g=4 m=1"], parity4, 3),
                                          ("parity g=8", rows["parity g=8 m=1"], parity8, 7)):
        for versions, memory in ((4, row["memory_x"]), (2, row["memory_synced_x"])):
            modes.append(RedundancyMode(f"{label}, {versions} versions", memory, row["pushed_x"], recovery, versions,
                                        exposed))
    return modes


def table(inputs: GoodputInputs, shape: JobShape, modes: Sequence[RedundancyMode],
          sizes: Sequence[int]) -> List[dict]:
    return [mode_row(inputs, shape, mode, n) for n in sizes for mode in modes]


def print_table(shape: JobShape, rows: List[dict]) -> None:
    print(f"per redundancy mode, {shape.name}: {shape.state_gb:g} GB of state per accelerator, {shape.host_gb:g} GB "
          f"of host memory for recoveries, {shape.network_gb_s:g} GB/s to push over, a {shape.copy_gb_s:g} GB/s copy "
          "(tools/goodput_modes.py: what is modelled; memory and traffic from bench/redundancy.py, R_ps from "
          "bench/recovery.py)")
    print(f"{'accelerators':>12}  {'mode':<26}{'memory':>9}{'fits':>6}{'pushed':>9}{'push':>7}{'overhead':>10}"
          f"{'R_ps':>7}{'goodput':>9}{'ckpt-restart':>14}")
    for row in rows:
        goodput = "-" if row["goodput"] is None else f"{row['goodput']:.2%}"
        fit = "yes" if row["fits"] else "no"
        print(f"{row['accelerators']:>12}  {row['mode']:<26}{row['memory_gb']:>7.1f}GB{fit:>6}"
              f"{row['pushed_gb']:>7.1f}GB{row['push_s']:>6.2f}s{row['overhead']:>10.2%}{row['recovery_s']:>6.1f}s"
              f"{goodput:>9}{row['restart']:>14.2%}")


def as_dict(shapes: Sequence[JobShape], modes: Sequence[RedundancyMode]) -> Dict[str, object]:
    return {"shapes": [asdict(s) for s in shapes], "modes": [asdict(m) for m in modes]}

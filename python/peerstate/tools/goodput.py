"""Expected goodput versus cluster size, for three ways of surviving failures.

Goodput is the fraction of wall-clock time spent on training steps that are
kept. With N accelerators failing independently at rate lam each (per second),
the job fails at rate N*lam, i.e. every M = 1 / (N*lam) seconds (its MTBF).

1. Checkpoint-restart (Young/Daly). A checkpoint stalls the job for d seconds
   every t seconds; a failure costs a restart of R seconds plus the work since
   the last checkpoint, t/2 on average. Per unit of time:
       G = 1 - d/t - (R + t/2)/M,     best at t = sqrt(2 d M)      (Young 1974)
   i.e. G* = 1 - sqrt(2 d / M) - R / M. (Daly 2006 refines t for t ~ M; at the
   scales here t << M and the first-order optimum is what Daly's reduces to.)
2. Job-level in-memory restart (HyperPod checkpointless, as published: under
   2 minutes per failure): G = (1 - o) * (1 - (R_mem + lag * s) / M), with the
   state taken every step (lag: steps lost per failure, s: the step time, o:
   the per-step capture overhead, taken equal to peerstate's).
3. peerstate: the same form with our measured per-step overhead o and our
   measured kill-to-first-step time R_ps, plus the failures that take a rank
   and all k of its buddies (probability q per failure): those fall back to a
   disk checkpoint, costing R + t'/2. Only those need the disk, so its
   optimal interval is t' = sqrt(2 d M / q):
       G = (1 - o) * (1 - d/t' - ((1-q) (R_ps + lag s) + q (R + t'/2)) / M)
   q = 1 - (1 - p_corr) * exp(-k * lam_node * W): a correlated loss of the
   buddy (p_corr), or an independent failure of one of the k buddy nodes
   during the window W before the replacement holds its copies again.

The Monte-Carlo mode draws failures over simulated time, node by node, and
plays the three strategies out (checkpoints, restarts, lost work, buddies
failing inside the window), to check the closed forms and to count how often
k buddies were not enough.

Defaults and sources: the failure rate is Llama 3's (Dubey et al., "The
Llama 3 Herd of Models", 2024, sec. 3.3.4: 419 unexpected interruptions in
54 days on 16,384 GPUs). The 2-minute in-memory restart and the 15-30
minutes of a classic restart are the SageMaker HyperPod announcements
(../shared/seeds). The classic restart R (10 min) and checkpoint stall d
(10 s) are not published figures: they are chosen so that checkpoint-restart
at Llama 3's scale gives about 90%, the effective training time Meta reports.
Every input is a flag of ``peerstate goodput``.

peerstate's recovery at N ranks, R_ps(N), is the sum of four terms, each said
in ``bench/README.md`` as measured or modelled:
- the data plane (measured, ``bench/recovery.py``: a small job's kill to first
  step, whose pulls per-rank state sets, not the job's size);
- the control plane and the rendezvous (measured, ``bench/scale.py``: failure
  to every simulated worker holding its instructions and the unique ids of its
  communicator), added as their growth from the smallest simulated size;
- NCCL's communicator (re)initialisation (modelled, not measurable here):
  ``comm_init_s(N) = comm_init_ref_s * (N / comm_init_ref_n) ** comm_init_exponent``.
  The default anchors on MegaScale (Jiang et al., NSDI 2024): a 2,048-GPU
  job's initialisation cut from 1,047 s to under 5 s. Linear growth from there
  is our assumption (NCCL's bootstrap gathers every rank's address; its
  scalable init, 2.23 and later, is meant to grow slower). A recovery pays it in full:
  the pinned torch (2.13) has ``shrink_group`` (NCCL 2.27's ``ncclCommShrink``)
  and ``split_group``, which drop ranks, but no grow (NCCL 2.29's
  ``ncclCommGrow``), which a spare taking a rank's place needs, so peerstate
  forms the epoch's communicator anew.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

STRATEGIES = ("checkpoint-restart", "in-memory restart (HyperPod)", "peerstate")
DEFAULT_SIZES = (1024, 4096, 16384, 32768, 65536, 100000)


@dataclass
class GoodputInputs:
    interruptions: float = 419          # Llama 3: unexpected interruptions ...
    days: float = 54                    # ... in this many days ...
    accelerators_observed: int = 16384  # ... on this many GPUs
    accelerators_per_node: int = 8
    checkpoint_stall_s: float = 10.0    # d: the job's stall per disk checkpoint
    restart_s: float = 600.0            # R: classic restart (reschedule, start, load)
    in_memory_restart_s: float = 120.0  # R_mem: HyperPod's published figure
    step_s: float = 5.0                 # s: one training step
    lag_steps: float = 1.5              # work lost per in-memory recovery, in steps
    peerstate_overhead: float = 0.0     # o: per-step capture overhead (fraction)
    peerstate_recovery_s: float = 1.0   # R_ps: kill to first step
    k: int = 1                          # buddy copies
    correlated: float = 0.01            # p_corr: a failure also takes a rank's buddy
    window_s: Optional[float] = None    # W: default R_ps + one step
    # The control plane's share of a recovery at N ranks, measured by bench/scale.py: (ranks, seconds).
    # R_ps(N) = R_ps + (C(N) - C(smallest measured)); past the largest, C grows linearly with N.
    control_plane: Tuple[Tuple[int, float], ...] = ()
    comm_init_ref_s: float = 5.0        # NCCL communicator initialisation: this long ...
    comm_init_ref_n: int = 2048         # ... at this many ranks (MegaScale) ...
    comm_init_exponent: float = 1.0     # ... growing as N to this power (modelled)

    def comm_init_s(self, accelerators: int) -> float:
        """NCCL's communicator (re)initialisation at ``accelerators`` ranks (modelled)."""
        return self.comm_init_ref_s * (accelerators / self.comm_init_ref_n) ** self.comm_init_exponent

    def control_plane_s(self, accelerators: int) -> float:
        """How much the measured control plane and rendezvous grow from the smallest
        simulated size to ``accelerators`` ranks (0 when not measured)."""
        curve = sorted(self.control_plane)
        if len(curve) < 2:
            return 0.0
        return max(0.0, _interpolate(curve, accelerators) - curve[0][1])

    def recovery_s(self, accelerators: int) -> float:
        """R_ps at ``accelerators`` ranks: the measured small job's kill-to-first-step (its
        data plane) plus the control plane's and rendezvous's growth (measured) plus NCCL's
        communicator initialisation (modelled); see the module docstring."""
        return self.peerstate_recovery_s + self.control_plane_s(accelerators) + self.comm_init_s(accelerators)

    @property
    def rate_per_accelerator(self) -> float:
        """lam, failures per accelerator-second."""
        return self.interruptions / (self.days * 86400.0 * self.accelerators_observed)

    def mtbf(self, accelerators: int) -> float:
        return 1.0 / (accelerators * self.rate_per_accelerator)

    @property
    def window(self) -> float:
        return self.window_s if self.window_s is not None else self.peerstate_recovery_s + self.step_s


def _interpolate(curve: Sequence[Tuple[int, float]], x: int) -> float:
    """Piecewise linear through ``curve``; linear in x past its ends (from the end segments)."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = curve[-2], curve[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def checkpoint_interval(inputs: GoodputInputs, accelerators: int) -> float:
    """Young's optimal checkpoint interval, sqrt(2 d M)."""
    return math.sqrt(2.0 * inputs.checkpoint_stall_s * inputs.mtbf(accelerators))


def buddy_loss_probability(inputs: GoodputInputs) -> float:
    """q: the chance that a failure leaves some shard with no copy."""
    node_rate = inputs.rate_per_accelerator * inputs.accelerators_per_node
    independent = 1.0 - math.exp(-inputs.k * node_rate * inputs.window)
    return 1.0 - (1.0 - inputs.correlated) * (1.0 - independent)


def peerstate_disk_interval(inputs: GoodputInputs, accelerators: int) -> float:
    """t': the disk checkpoint interval when only a fraction q of failures needs it."""
    q = max(buddy_loss_probability(inputs), 1e-12)
    return math.sqrt(2.0 * inputs.checkpoint_stall_s * inputs.mtbf(accelerators) / q)


def closed_form(inputs: GoodputInputs, accelerators: int) -> Dict[str, float]:
    m = inputs.mtbf(accelerators)
    t = checkpoint_interval(inputs, accelerators)
    t_disk = peerstate_disk_interval(inputs, accelerators)
    lost_in_memory = inputs.lag_steps * inputs.step_s
    q = buddy_loss_probability(inputs)
    keep = 1.0 - inputs.peerstate_overhead
    peer_loss = (1 - q) * (inputs.recovery_s(accelerators) + lost_in_memory) + q * (inputs.restart_s + t_disk / 2.0)
    return {
        "checkpoint-restart": max(0.0, 1.0 - inputs.checkpoint_stall_s / t - (inputs.restart_s + t / 2.0) / m),
        "in-memory restart (HyperPod)": max(0.0, keep * (1.0 - (inputs.in_memory_restart_s + lost_in_memory) / m)),
        "peerstate": max(0.0, keep * (1.0 - inputs.checkpoint_stall_s / t_disk - peer_loss / m)),
    }


def monte_carlo(inputs: GoodputInputs, accelerators: int, *, days: float = 30.0, seed: int = 0) -> Dict[str, float]:
    """Goodput of each strategy played out over ``days`` of simulated wall-clock time,
    and how many failures left a shard without a copy (``buddy_losses`` of ``failures``).

    Failures arrive node by node (Poisson). Each strategy walks the same failures:
    between two of them the job works in cycles (work, then a checkpoint stall);
    a failure throws away what was not saved and costs a restart, during which a
    new failure starts the restart again.
    """
    draw = random.Random(seed)
    nodes = max(2, accelerators // inputs.accelerators_per_node)
    node_rate = inputs.rate_per_accelerator * inputs.accelerators_per_node
    horizon = days * 86400.0
    failures = []
    t = 0.0
    while True:
        t += draw.expovariate(node_rate * nodes)
        if t >= horizon:
            break
        failures.append((t, draw.randrange(nodes)))

    def play(cost_of, work_per_second: float, interval: float, stall: float) -> float:
        """Useful seconds: disk-checkpointed work between failures, minus what a
        failure's cost_of(i) says it throws away (None: back to the last checkpoint)."""
        useful, resumed = 0.0, 0.0
        for i, (time, _) in enumerate(failures):
            if time < resumed:  # failed again while recovering: the recovery starts over
                resumed = time + cost_of(i)[0]
                continue
            span = time - resumed
            restart, lost = cost_of(i)
            saved, tail = _cycles(span, interval, stall)
            kept_tail = 0.0 if lost is None else max(0.0, tail - lost)
            useful += (saved + kept_tail) * work_per_second
            resumed = time + restart
        saved, tail = _cycles(max(0.0, horizon - resumed), interval, stall)
        useful += (saved + tail) * work_per_second
        return useful / horizon

    interval = checkpoint_interval(inputs, accelerators)
    lost_in_memory = inputs.lag_steps * inputs.step_s
    classic = play(lambda i: (inputs.restart_s, None), 1.0, interval, inputs.checkpoint_stall_s)
    keep = 1.0 - inputs.peerstate_overhead
    in_memory = play(lambda i: (inputs.in_memory_restart_s, lost_in_memory), keep, math.inf, 0.0)

    # peerstate: a failure goes to disk when it also takes its buddy (correlated) or
    # when one of its node's k buddy nodes failed within the window before it.
    last_failure: Dict[int, float] = {}
    to_disk = []
    for time, node in failures:
        exposed = any(time - last_failure.get((node - j) % nodes, -math.inf) < inputs.window
                      for j in range(1, inputs.k + 1))
        to_disk.append(draw.random() < inputs.correlated or exposed)
        last_failure[node] = time
    t_disk = peerstate_disk_interval(inputs, accelerators)
    ours = play(lambda i: (inputs.restart_s, None) if to_disk[i] else (inputs.recovery_s(accelerators), lost_in_memory),
                keep, t_disk, inputs.checkpoint_stall_s)
    return {"checkpoint-restart": classic, "in-memory restart (HyperPod)": in_memory, "peerstate": ours,
            "failures": len(failures), "buddy_losses": sum(to_disk)}


def _cycles(span: float, interval: float, stall: float):
    """The work saved by the whole (work, checkpoint) cycles in ``span``, and the
    work done after the last of them."""
    if math.isinf(interval):
        return 0.0, span
    cycles = math.floor(span / (interval + stall))
    return cycles * interval, min(span - cycles * (interval + stall), interval)


def inputs_from_results(results_dir: Path, **overrides) -> GoodputInputs:
    """Defaults, with peerstate's overhead, recovery time and control-plane curve read
    from the benchmarks (bench/results/overhead.json, recovery.json, scale.json) where
    they exist."""
    values = {}
    overhead = results_dir / "overhead.json"
    if overhead.exists():
        summary = json.loads(overhead.read_text())["summary"]
        values["peerstate_overhead"] = max(0.0, summary["overhead_percent"] / 100.0)
    recovery = results_dir / "recovery.json"
    if recovery.exists():
        rows = json.loads(recovery.read_text())["rows"]
        values["peerstate_recovery_s"] = next(r["ours_s"] for r in rows if r["phase"] == "kill to first step")
    scale = results_dir / "scale.json"
    if scale.exists():
        values["control_plane"] = tuple((r["ranks"], r["ours_s"]) for r in json.loads(scale.read_text())["rows"])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return GoodputInputs(**values)


def table(inputs: GoodputInputs, sizes: Sequence[int], monte_carlo_days: float = 0.0,
          seed: int = 0) -> List[dict]:
    rows = []
    for n in sizes:
        row = {"accelerators": n, "mtbf_h": inputs.mtbf(n) / 3600.0, "peerstate_recovery_s": inputs.recovery_s(n),
               "control_plane_s": inputs.control_plane_s(n), "comm_init_s": inputs.comm_init_s(n),
               "checkpoint_interval_min": checkpoint_interval(inputs, n) / 60.0,
               **{f"closed {k}": v for k, v in closed_form(inputs, n).items()}}
        if monte_carlo_days:
            simulated = monte_carlo(inputs, n, days=monte_carlo_days, seed=seed)
            row.update({f"simulated {k}": v for k, v in simulated.items()})
        rows.append(row)
    return rows


def print_table(inputs: GoodputInputs, rows: List[dict]) -> None:
    print(f"failure rate {inputs.rate_per_accelerator * 3600 * 1e6:.2f} per million accelerator-hours "
          f"({inputs.interruptions:g} in {inputs.days:g} days on {inputs.accelerators_observed} accelerators); "
          f"peerstate: overhead {inputs.peerstate_overhead:.1%}, recovery {inputs.peerstate_recovery_s:.2f}s at 4 ranks "
          f"(R_ps: plus the control plane's and rendezvous's growth, bench/scale.py"
          f"{'' if inputs.control_plane else ': not measured'}, plus NCCL's communicator init, modelled: "
          f"{inputs.comm_init_ref_s:g}s at {inputs.comm_init_ref_n} ranks, x N^{inputs.comm_init_exponent:g}), "
          f"k={inputs.k}, buddy-loss probability {buddy_loss_probability(inputs):.4f} per failure")
    simulated = "simulated peerstate" in rows[0]
    header = (f"{'accelerators':>12}{'MTBF h':>9}{'ckpt every':>11}{'ctl+rdzv':>9}{'comm init':>10}{'R_ps':>7}"
              + "".join(f"{s[:18]:>20}" for s in STRATEGIES))
    if simulated:
        header += f"{'sim ckpt':>10}{'sim mem':>9}{'sim ours':>10}{'lost/failures':>15}"
    print(header)
    for row in rows:
        line = (f"{row['accelerators']:>12}{row['mtbf_h']:>9.2f}{row['checkpoint_interval_min']:>9.1f}m"
                f"{row['control_plane_s']:>8.2f}s{row['comm_init_s']:>9.1f}s{row['peerstate_recovery_s']:>6.1f}s"
                + "".join(f"{row[f'closed {s}']:>20.2%}" for s in STRATEGIES))
        if simulated:
            line += (f"{row['simulated checkpoint-restart']:>10.2%}"
                     f"{row['simulated in-memory restart (HyperPod)']:>9.2%}{row['simulated peerstate']:>10.2%}"
                     f"{row['simulated buddy_losses']:>8}/{row['simulated failures']:<6}")
        print(line)


def plot(inputs: GoodputInputs, path: Path, sizes: Sequence[int] = ()) -> bool:
    """Goodput versus cluster size, one line per strategy. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = list(sizes) or [int(1000 * 100 ** (i / 40)) for i in range(41)]
    figure, axes = plt.subplots(figsize=(8, 4.8), dpi=120)
    for strategy, color in zip(STRATEGIES, ("#c0392b", "#e69f00", "#0072b2")):
        axes.plot(sizes, [100 * closed_form(inputs, n)[strategy] for n in sizes], label=strategy, color=color,
                  linewidth=2.2)
    for n in (4096, 16384):
        value = 100 * closed_form(inputs, n)["peerstate"]
        axes.annotate(f"{value:.1f}%", (n, value), textcoords="offset points", xytext=(0, 8), ha="center",
                      color="#0072b2", fontsize=9)
        axes.axvline(n, color="#999999", linewidth=0.8, linestyle=":")
    axes.set_xscale("log")
    axes.set_xlabel("accelerators in the job")
    axes.set_ylabel("expected goodput (%)")
    axes.set_ylim(0, 100)
    axes.grid(True, which="both", alpha=0.3)
    axes.set_title(f"Goodput vs cluster size (Llama 3 failure rate; peerstate recovery "
                   f"{inputs.peerstate_recovery_s:.1f}s, overhead {inputs.peerstate_overhead:.1%})", fontsize=10)
    axes.legend(loc="lower left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return True


def as_dict(inputs: GoodputInputs) -> dict:
    return {**asdict(inputs), "rate_per_accelerator_hour": inputs.rate_per_accelerator * 3600,
            "buddy_loss_probability": buddy_loss_probability(inputs)}

"""The demo's printed summary and its picture (loss vs step, recovery timelines)."""

from __future__ import annotations

import re
from pathlib import Path

from peerstate.control.memory_figures import describe_memory

PHASE_COLORS = {"detect": "#d55e00", "plan": "#cc79a7", "abort": "#e69f00", "re-form": "#f0e442", "transfer": "#009e73",
                "restore": "#56b4e9", "first step": "#0072b2"}
BASELINE_COLORS = ("#bbbbbb", "#888888", "#555555")


def _fault_step(event: dict):
    match = re.search(r"after step (\d+)", event.get("fault", ""))
    return int(match.group(1)) if match else None


def summary(report: dict) -> str:
    lines = ["", "recoveries (from the fault to the first completed step after it):"]
    for recovery in report["recoveries"]:
        phases = " · ".join(f"{name} {seconds:.3f}s" for name, seconds in recovery["phases_s"].items()
                            if seconds is not None)
        lines.append(f"  epoch {recovery['epoch']}: {recovery['reason']}; ranks {recovery['failed']} replaced, "
                     f"back at step {recovery.get('version', '?')} + 1 in {recovery['total_s']:.2f}s")
        lines.append(f"    {phases}")
    end = report.get("job_end") or {}
    if end:
        lines.append(f"goodput of the run: {end['goodput']:.1%} ({end['steps']} steps in {end['wall_s']:.1f}s, of "
                     f"which {end['lost_s']:.2f}s lost to failures; a fault-free step takes "
                     f"{end['median_step_s']:.3f}s)")
    if report.get("memory"):
        lines.append(describe_memory(report["memory"]))
    baseline = report["restart_baseline"]
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in baseline["phases_s"].items())
    lines.append(f"restart from a checkpoint on local disk, same state: {baseline['total_s']:.2f}s to the first "
                 f"step ({parts})")
    if report["recoveries"]:
        fastest = min(r["total_s"] for r in report["recoveries"])
        lines.append(f"  -> peerstate's fastest recovery here was {baseline['total_s'] / fastest:.0f}x faster "
                     "(and the classic way would also replay the steps since its last checkpoint)")
    check = report["bitwise"]
    verdict = "PASS" if check["equal"] else "FAIL"
    lines.append(f"bitwise check: {verdict}: the final {check['parameters']:,} parameters "
                 + ("equal the fault-free run's, bit for bit" if check["equal"]
                    else f"differ from the fault-free run's in {check['different']}"))
    return "\n".join(lines)


def draw(report: dict, path: Path) -> bool:
    """report.png: loss vs step with the failures marked, and the recovery timelines
    beside the restart baseline. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), dpi=110, gridspec_kw={"height_ratios": [3, 2]})

    reference, faulty = report["reference"]["loss"], report["faulty"]["loss"]
    top.plot(sorted(map(int, reference)), [reference[k] for k in sorted(reference, key=int)], color="#bbbbbb",
             linewidth=5, label="fault-free run")
    top.plot(sorted(map(int, faulty)), [faulty[k] for k in sorted(faulty, key=int)], color="#0072b2",
             linewidth=1.4, label="run with failures, recovered in place")
    for event in report["injected"]:
        step = _fault_step(event)
        if step is None:
            continue
        top.axvline(step + 0.5, color="#d55e00", linewidth=1.5)
        top.annotate(event["fault"].split(" after")[0], (step + 0.5, 0.0), xycoords=("data", "axes fraction"),
                     xytext=(4, 6), textcoords="offset points", color="#d55e00", fontsize=9)
    top.set_xlabel("step")
    top.set_ylabel("training loss")
    verdict = "final weights bit-identical to the fault-free run" if report["bitwise"]["equal"] \
        else "final weights NOT bit-identical to the fault-free run"
    goodput = f"; goodput {report['goodput']:.1%}" if report.get("goodput") else ""
    top.set_title(f"Loss vs step: failures injected, recovered without a checkpoint\n({verdict}{goodput})",
                  fontsize=11)
    top.legend(loc="upper right")
    top.grid(alpha=0.3)

    rows = []
    for recovery in report["recoveries"]:
        rows.append((f"epoch {recovery['epoch']}: ranks {recovery['failed']}",
                     [(name, s or 0.0, PHASE_COLORS[name]) for name, s in recovery["phases_s"].items()],
                     recovery["total_s"]))
    baseline = report["restart_baseline"]
    rows.append(("restart from checkpoint\n(same state)",
                 [(name, s, color) for (name, s), color in zip(baseline["phases_s"].items(), BASELINE_COLORS)],
                 baseline["total_s"]))
    seen = set()
    for y, (label, phases, total) in enumerate(rows):
        left = 0.0
        for name, seconds, color in phases:
            bottom.barh(y, seconds, left=left, color=color, edgecolor="white", height=0.6,
                        label=name if name not in seen else None)
            seen.add(name)
            left += seconds
        bottom.text(left, y, f"  {total:.2f}s", va="center", fontsize=9)
    bottom.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=9)
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds from the fault to the first completed step")
    bottom.set_title("Recovery timelines (peerstate) beside a classic restart", fontsize=11)
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, ncol=5, frameon=False)
    bottom.grid(axis="x", alpha=0.3)
    bottom.set_xlim(0, max(r[2] for r in rows) * 1.15)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True

"""The host memory ranks hold for recoveries, as the job reports it: each rank's
``memory`` event (``Job.memory()``'s figures, written once its state and the
replicas it holds are allocated, and again when it finishes), and the one line
that says them in the run's summary (the agent's, per node) and the demo's."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping

MEMORY_FIELDS = ("snapshot_per_version", "snapshots_held", "replicas_held", "replicas_reserved")  # Job.memory()
MEMORY_EVENT = "memory"


def latest_per_rank(events: Iterable[Mapping[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """rank -> its latest ``memory`` event (a rank taken by a spare: the spare's)."""
    latest: Dict[int, Dict[str, Any]] = {}
    for event in events:
        if event.get("event", MEMORY_EVENT) == MEMORY_EVENT and event.get("rank") is not None:
            latest[int(event["rank"])] = dict(event)
    return latest


def describe_memory(per_rank: Mapping[Any, Mapping[str, Any]]) -> str:
    """One line for a person: the most any rank holds of each kind, as bytes and as a
    multiple of what it copies a step (its state), and of its share of its node's
    memory where the ranks said it (``node_share``)."""
    most = {field: max(m[field] for m in per_rank.values()) for field in MEMORY_FIELDS}
    copied = most["snapshot_per_version"] or 1
    total = most["snapshots_held"] + most["replicas_held"]
    shares = [m["node_share"] for m in per_rank.values() if m.get("node_share")]
    share = min(shares) if shares else 0
    of_share = f", {100 * total / share:.2g}% of its share of the node ({share / 1e9:.1f} GB)" if share else ""
    # What it holds for others: its buddies' replicas, or its parity group's blocks (Job(parity_group=g)).
    others = "parity group's blocks" if any(m.get("redundancy") == "parity" for m in per_rank.values()) \
        else "buddies' replicas"
    return (f"host memory a rank holds for recoveries (the most of {len(per_rank)} ranks): its snapshots "
            f"{most['snapshots_held'] / 1e6:.1f} MB ({most['snapshots_held'] / copied:.1f}x what it copies a step, "
            f"{copied / 1e6:.1f} MB), its {others} {most['replicas_held'] / 1e6:.1f} MB "
            f"({most['replicas_held'] / copied:.1f}x); {total / copied:.1f}x its state in all{of_share}")

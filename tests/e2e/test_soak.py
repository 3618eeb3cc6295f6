"""The soak's quick form (``bench/soak.py --quick``): about ten faults drawn from
every kind (a worker killed, a hang, a node killed, a spare killed, a kill inside
a recovery, a hang then a kill of its buddy, a rank and its buddy killed at once)
on a real job over a real 3-member etcd, with real signals. It asserts what the
soak asserts: every fault recovered, or back from the disk checkpoint where it
took every copy of some state; nothing lost; no round stopped; no process left
behind; the final parameters bit for bit those of the fault-free run. Its times
and memory are the benchmark's to report (bench/README.md, "Soak"), not a test's
to assert on a shared CI machine."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from helpers.etcd import require_etcd  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench"
SOAK = BENCH / "soak.py"


def test_a_quick_soak_recovers_every_fault_of_every_kind_and_ends_bitwise(tmp_path):
    require_etcd()
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(SOAK), "--quick", "--keep", str(tmp_path / "logs"), "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert out.exists(), f"no result (exit {run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    summary = json.loads(out.read_text())["summary"]
    print(run.stdout[-3000:])  # its figures, in the test's output
    assert summary["faults"] >= 10, summary["by_kind"]
    # Every kind landed (the seed draws each; a killed spare is replaced, which the outcomes
    # below check: "spare not replaced" is not among them).
    assert all(summary["by_kind"].values()), summary["by_kind"]
    assert not summary["lost"], run.stdout[-3000:]
    assert not summary["unexpected_fallbacks"], run.stdout[-3000:]
    assert not summary["failed_rounds"], run.stdout[-3000:]
    assert set(summary["outcomes"]) <= {"recovered", "checkpoint", "spare replaced", "no recovery followed"}, \
        summary["outcomes"]
    assert summary["leftover_processes"] == 0
    assert summary["bitwise"]["equal"], summary["bitwise"]
    assert run.returncode == 0, run.stdout[-3000:]


def _event(name, time, **fields):
    return {"event": name, "time": time, **fields}


def _summary(analysis, faults, memory=None):
    """The soak's summary of one round of ``faults`` (and workers' ``memory``), bitwise equal."""
    return analysis.summarise([{"faults": faults, "memory": memory or {}, "unexplained": [], "leftover": [],
                            "failure": None, "round": 0, "log": ""}], {"equal": True, "tensors": 1})


def _soak_modules():
    """bench/soak.py and its analysis (bench/soak_analysis.py, which it imports from beside it)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, importlib.import_module("soak_analysis")


def test_the_soak_counts_a_pair_lost_by_two_faults_in_flight_together_as_every_copy_taken():
    # From a real round: a hang of rank 3 and, 0.4 s later, a kill of its buddy rank 1 (two
    # scenarios). The kill's plan (epoch 1) is overtaken by the hang's (epoch 2) before it
    # completes; the fallback is expected for both, and the hung rank's copy is flagged.
    soak, analysis = _soak_modules()

    events = [
        _event("fault_injected", 10.0, scenario=0, scenario_kind="hang", kind="hang", rank=3),
        _event("fault_injected", 10.4, scenario=1, scenario_kind="kill", kind="kill", rank=1),
        _event("plan", 10.45, epoch=1, failed=[1], detected_at=10.42),
        _event("process_exited", 10.8, rank=3, worker="n1.1", code=-9,
               how="hung (its progress counter stopped) and was killed"),
        _event("plan", 10.85, epoch=2, failed=[3], detected_at=10.8),
        _event("checkpoint_fallback", 11.5, epoch=2),
        _event("recovery", 11.9, epoch=2, marks={"0": {"first step": 11.9}}, phases_s={"plan": 0.1}),
        _event("fault_injected", 20.0, scenario=2, scenario_kind="kill", kind="kill", rank=2),
        _event("plan", 20.05, epoch=3, failed=[2], detected_at=20.02),
        _event("recovery", 20.4, epoch=3, marks={"0": {"first step": 20.4}}, phases_s={"plan": 0.03}),
    ]
    hang, kill, alone = analysis.analyse(events, soak.buddies())
    assert soak.buddies()[1] == 3
    for fault in (hang, kill):
        assert fault["outcome"] == "checkpoint" and fault["every_copy_taken"] and fault["hung_copy"], fault
    assert alone["outcome"] == "recovered" and not alone["every_copy_taken"], alone
    assert abs(alone["seconds"] - 0.4) < 1e-9
    summary = _summary(analysis, [hang, kill, alone])
    assert not summary["unexpected_fallbacks"] and len(summary["hung_copy_fallbacks"]) == 2


def test_a_fallback_though_the_hung_one_of_the_pair_was_kept_for_its_replacement_is_unexpected():
    # The same two faults, with the hung rank frozen for its replacement to read: its memory
    # was a source, so falling back is a finding; killed at once (it had no index), it is a
    # known limit, listed apart.
    soak, analysis = _soak_modules()

    def run(frozen):
        events = [
            _event("fault_injected", 10.0, scenario=0, scenario_kind="hang-then-kill-buddy", kind="hang", rank=3),
            _event("fault_injected", 10.4, scenario=0, scenario_kind="hang-then-kill-buddy", kind="kill", rank=1),
            _event("plan", 10.45, epoch=1, failed=[1], detected_at=10.42),
            *([_event("hung_worker_frozen", 10.8, rank=3, worker="n1.1")] if frozen else []),
            _event("plan", 10.85, epoch=2, failed=[3], detected_at=10.8),
            _event("process_exited", 11.0, rank=3, worker="n1.1", code=-9,
                   how="hung (its progress counter stopped) and was killed"),
            _event("checkpoint_fallback", 11.5, epoch=2),
            _event("recovery", 11.9, epoch=2, marks={"0": {"first step": 11.9}}, phases_s={"plan": 0.1}),
        ]
        [fault] = analysis.analyse(events, soak.buddies())
        assert fault["every_copy_taken"] and fault["hung_copy"] and fault["frozen_copy"] == frozen, fault
        return _summary(analysis, [fault])

    kept = run(frozen=True)
    assert len(kept["unexpected_fallbacks"]) == 1 and not kept["hung_copy_fallbacks"]
    killed = run(frozen=False)
    assert not killed["unexpected_fallbacks"] and len(killed["hung_copy_fallbacks"]) == 1


def test_only_the_last_hung_worker_of_a_rank_says_whether_its_copy_was_kept():
    # From the quick soak: rank 2's worker n1.0 hung, was kept and read by its replacement
    # n1.5, which hung in turn and was killed at once (then, with no index check it could
    # pass); the pair's fallback is on n1.5, whose copy nobody kept.
    soak, analysis = _soak_modules()
    events = [
        _event("fault_injected", 10.0, scenario=0, scenario_kind="hang", kind="hang", rank=2),
        _event("hung_worker_frozen", 11.0, rank=2, worker="n1.0"),
        _event("plan", 11.02, epoch=1, failed=[2], detected_at=11.0),
        _event("fault_injected", 11.1, scenario=1, scenario_kind="hang-then-kill-buddy", kind="hang", rank=2),
        _event("process_exited", 11.2, rank=2, worker="n1.0", code=-9, how="hung: frozen (...) and was killed"),
        _event("fault_injected", 11.5, scenario=1, scenario_kind="hang-then-kill-buddy", kind="kill", rank=0),
        _event("plan", 11.52, epoch=2, failed=[0], detected_at=11.5),
        _event("process_exited", 12.1, rank=2, worker="n1.5", code=-9, how="hung: frozen (...) and was killed"),
        _event("plan", 12.4, epoch=3, failed=[2], detected_at=12.1),
        _event("checkpoint_fallback", 12.6, epoch=3),
        _event("recovery", 13.0, epoch=3, marks={"0": {"first step": 13.0}}, phases_s={"plan": 0.3}),
    ]
    for fault in analysis.analyse(events, soak.buddies()):
        assert fault["outcome"] == "checkpoint" and fault["hung_copy"] and not fault["frozen_copy"], fault


def test_a_kept_copy_of_one_pair_does_not_make_another_pairs_fallback_unexpected():
    # From the quick soak in CI: rank 2 hung (kept for its replacement) and its buddy rank 0 was
    # killed; before that recovery's first step, rank 1 and its buddy rank 3 were killed together.
    # The fallback is that second pair's (every copy of rank 3 taken), expected for both faults;
    # the first pair's kept copy was a source and counted as one. Judged over the ranks of both
    # pairs at once, the kept copy made the fallback a finding.
    soak, analysis = _soak_modules()

    def run(second_pair_killed):
        events = [
            _event("fault_injected", 46.46, scenario=7, scenario_kind="hang-then-kill-buddy", kind="hang", rank=2),
            _event("fault_injected", 47.01, scenario=7, scenario_kind="hang-then-kill-buddy", kind="kill", rank=0),
            _event("plan", 47.05, epoch=9, failed=[0], detected_at=47.02),
            _event("hung_worker_frozen", 47.48, rank=2, worker="n1.8"),
            _event("plan", 47.51, epoch=10, failed=[2], detected_at=47.48),
            _event("process_exited", 47.70, rank=2, worker="n1.8", code=-9, how="hung: frozen (...) and was killed"),
            *([_event("fault_injected", 48.38, scenario=8, scenario_kind="kill-with-buddy", kind="kill", rank=3),
               _event("fault_injected", 48.39, scenario=8, scenario_kind="kill-with-buddy", kind="kill", rank=1),
               _event("plan", 48.52, epoch=11, failed=[1, 3], detected_at=48.41),
               _event("checkpoint_fallback", 48.53, epoch=11, message="ranks 1 and 3 lost; ...")]
              if second_pair_killed else [_event("checkpoint_fallback", 47.6, epoch=10, message="ranks 0 and 2 lost")]),
            _event("recovery", 49.10, epoch=11 if second_pair_killed else 10, marks={"0": {"first step": 49.10}},
                   phases_s={"plan": 0.1}),
        ]
        faults = analysis.analyse(events, soak.buddies())
        return faults, _summary(analysis, faults)

    faults, summary = run(second_pair_killed=True)
    assert soak.buddies()[0] == 2 and soak.buddies()[1] == 3
    assert [f["outcome"] for f in faults] == ["checkpoint", "checkpoint"], faults
    assert all(f["every_copy_taken"] and not f["frozen_copy"] for f in faults), faults
    assert not summary["unexpected_fallbacks"], summary["unexpected_fallbacks"]
    # Alone, the kept pair's fallback is still a finding.
    [alone], summary = run(second_pair_killed=False)
    assert alone["frozen_copy"] and summary["unexpected_fallbacks"] == [alone], alone


def test_a_kill_within_a_step_of_a_fallback_is_counted_apart_not_as_an_unexpected_fallback():
    # From a real round (seed 11's round 4): rank 2 killed 0.1 s after a recovery from the
    # checkpoint, before its first new copy reached its buddy. It falls back again (correctly:
    # there is no copy yet), and the analysis says why instead of calling it unexpected.
    soak, analysis = _soak_modules()

    events = [
        _event("fault_injected", 73.86, scenario=6, scenario_kind="kill", kind="kill", rank=2),
        _event("plan", 73.96, epoch=9, failed=[2], detected_at=73.87),
        _event("checkpoint_fallback", 74.03, epoch=9, message="rank 2 lost; rank 2 has no committed copy on any "
                                                             "holder yet"),
        _event("recovery", 74.81, epoch=9, marks={"0": {"first step": 74.81}}, phases_s={"plan": 0.1}),
    ]
    [fault] = analysis.analyse(events, soak.buddies())
    assert fault["outcome"] == "checkpoint" and not fault["every_copy_taken"] and fault["no_copy_yet"], fault
    summary = _summary(analysis, [fault])
    assert not summary["unexpected_fallbacks"] and summary["no_copy_yet_fallbacks"] == [fault]


def test_a_kill_just_after_a_fallback_whose_holders_hold_mixed_steps_is_in_the_same_window():
    # From a real round (seed 11's round 4, 12:57 run): rank 2 killed 0.13 s after the first
    # step of a recovery from the checkpoint; some ranks' first copies had reached their
    # holders, others' not, so no version was held for every rank. The same window as above,
    # seen from the holders; the same message a second after the recovery would be a finding.
    soak, analysis = _soak_modules()

    def round_with_kill_at(kill):
        return [
            _event("plan", 74.0, epoch=8, failed=[3], detected_at=73.9),
            _event("checkpoint_fallback", 75.45, epoch=8, message="ranks 1 and 3 lost; ..."),
            _event("recovery", 75.90, epoch=8, marks={"0": {"first step": 75.90}}, phases_s={"plan": 0.1}),
            _event("fault_injected", kill, scenario=6, scenario_kind="kill", kind="kill", rank=2),
            _event("plan", kill + 0.1, epoch=9, failed=[2], detected_at=kill + 0.01),
            _event("checkpoint_fallback", kill + 0.11, epoch=9, message="rank 2 lost; no version is held for "
                                                                         "every rank at once (the copies are of "
                                                                         "different steps)"),
            _event("recovery", kill + 0.9, epoch=9, marks={"0": {"first step": kill + 0.9}}, phases_s={"plan": 0.1}),
        ]

    [fault] = analysis.analyse(round_with_kill_at(76.03), soak.buddies())
    assert fault["outcome"] == "checkpoint" and not fault["every_copy_taken"] and fault["no_copy_yet"], fault
    [late] = analysis.analyse(round_with_kill_at(76.03 + analysis.WINDOW_SECONDS), soak.buddies())
    assert late["outcome"] == "checkpoint" and not late["no_copy_yet"], late


def test_a_kill_while_a_recovery_is_in_flight_that_finds_mixed_steps_is_in_the_same_window():
    # From a real round (quick soak, 2026-12-06): rank 2 killed, and rank 3 killed 0.27 s later,
    # before that recovery's first step. The abort of epoch 7 cut rank 3's push of the recovery
    # point (its holder kept 258), and rank 2's replacement held only 259: no common step. The
    # same window; a second kill after the recovery's first step finding the same would not be.
    soak, analysis = _soak_modules()

    def kill_in_recovery(second, first_recovered=False):
        return [
            _event("fault_injected", 40.24, scenario=6, scenario_kind="kill-in-recovery", kind="kill", rank=2),
            _event("plan", 40.28, epoch=7, failed=[2], detected_at=40.25),
            *([_event("recovery", 40.45, epoch=7, marks={"0": {"first step": 40.45}}, phases_s={"plan": 0.03})]
              if first_recovered else []),
            _event("fault_injected", second, scenario=6, scenario_kind="kill-in-recovery", kind="kill", rank=3),
            _event("plan", second + 0.04, epoch=8, failed=[3], detected_at=second + 0.01),
            _event("checkpoint_fallback", second + 0.06, epoch=8, message="rank 3 lost; no version is held for "
                                                                          "every rank at once (the copies are of "
                                                                          "different steps)"),
            _event("recovery", second + 0.5, epoch=8, marks={"0": {"first step": second + 0.5}},
                   phases_s={"plan": 0.03}),
        ]

    [fault] = analysis.analyse(kill_in_recovery(40.51), soak.buddies())
    assert fault["outcome"] == "checkpoint" and not fault["every_copy_taken"] and fault["no_copy_yet"], fault
    assert not _summary(analysis, [fault])["unexpected_fallbacks"]
    after = kill_in_recovery(40.45 + analysis.WINDOW_SECONDS + 0.1, first_recovered=True)
    [later] = analysis.analyse(after, soak.buddies())
    assert later["outcome"] == "checkpoint" and not later["no_copy_yet"], later


class _StalledJob:
    """The part of ``LocalJob`` that ``dump_stalled`` reads (a second implementation:
    its log folder, and the live processes holding ranks)."""

    def __init__(self, logs: Path, rank_pids: dict) -> None:
        self.logs = logs
        self._rank_pids = rank_pids

    def rank_pids(self):
        return self._rank_pids


def test_a_stalled_epoch_has_every_worker_print_its_stacks_once(tmp_path):
    # A real process with soak_job.py's handler stands in for a worker stuck in a recovery.
    soak, _ = _soak_modules()
    stderr = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, "-c", "import faulthandler, signal, sys, time\n"
                               "faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
                               "def stuck_in_a_recovery():\n"
                               "    print('ready', flush=True)\n"
                               "    time.sleep(60)\n"
                               "stuck_in_a_recovery()\n"],
                              stdout=subprocess.PIPE, stderr=open(stderr, "w"), text=True)
    try:
        assert worker.stdout.readline() == "ready\n"
        job = _StalledJob(tmp_path, {1: [worker.pid]})
        now = time.time()
        fresh = [_event("plan", now - 1.0, epoch=3, failed=[1])]
        dumped = set()
        soak.dump_stalled(job, fresh, dumped)  # 1 s old: not stalled yet
        stalled = [_event("plan", now - soak.STALL_SECONDS - 1, epoch=3, failed=[1])]
        joined = stalled + [_event("joined", now, epoch=3, rank=1)]
        soak.dump_stalled(job, joined, dumped)  # joined: not stalled
        assert not dumped and not (tmp_path / "events.jsonl").exists()
        soak.dump_stalled(job, stalled, dumped)
        soak.dump_stalled(job, stalled, dumped)  # once per epoch
        deadline = time.monotonic() + 10
        while "stuck_in_a_recovery" not in stderr.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "stuck_in_a_recovery" in stderr.read_text()
        written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [(e["event"], e["epoch"], e["pids"]) for e in written] == [("stacks_dumped", 3, [worker.pid])]
        assert worker.poll() is None  # a dump, not a kill
    finally:
        worker.kill()
        worker.wait()


def test_memory_growth_is_reported_from_the_first_sample_and_after_the_warm_up():
    # A worker that grows 10% in its first seconds (its warm-up) and then 2% across a recovery:
    # the second figure starts at its first sample WARM_UP_SECONDS after its first one. A worker
    # that lived through no recovery after its warm-up is not measured across recoveries.
    _, analysis = _soak_modules()
    samples = [[100.0, 1000, 3], [105.0, 1100, 3], [100.0 + analysis.WARM_UP_SECONDS, 1120, 3], [160.0, 1130, 4],
               [162.0, 1142.4, 4]]
    quiet = [[100.0, 600, 3], [100.0 + analysis.WARM_UP_SECONDS, 700, 3], [150.0, 900, 3]]
    summary = _summary(analysis, [], {"7": samples, "8": [[100.0, 500, 3]], "9": quiet})
    assert abs(summary["memory_growth_max"] - 0.5) < 1e-9 and summary["workers_measured"] == 2
    assert abs(summary["memory_growth_after_warm_up_max"] - 0.02) < 1e-9
    assert summary["workers_measured_after_warm_up"] == 1
    # From the soak of 2026-12-03: a survivor sampled just after a recovery is part way through
    # rebuilding what its abort released, 5% under its level; that sample is not a start.
    # Its samples (MiB): the ones right after recoveries 3 and 4 read 305.8 and 310.6.
    dipped = [[0.0, 317.2, 0], [1.8, 316.4, 1], [3.8, 317.6, 2], [11.9, 321.1, 2], [13.1, 305.8, 3],
              [15.1, 320.9, 3], [15.7, 310.6, 4], [17.7, 322.4, 4], [19.7, 321.1, 4], [20.6, 320.5, 5],
              [22.6, 321.5, 5], [24.6, 321.7, 5]]
    summary = _summary(analysis, [], {"7": dipped})
    assert abs(summary["memory_growth_after_warm_up_max"] - (321.7 / 320.9 - 1)) < 1e-9, summary

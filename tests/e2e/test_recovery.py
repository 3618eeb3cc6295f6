"""In-process recovery end to end: real agents, real workers (DDP over gloo), real
signals. Every faulty run must end with the parameters of the fault-free run,
bit for bit."""

import mmap
import os
import platform
import re
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from helpers.jobs import FAST, STEPS, Job, assert_bitwise  # noqa: E402

from peerstate.control.environment import ABORT_DEADLINE_EXIT_CODE  # noqa: E402
from peerstate.control.memory_figures import MEMORY_FIELDS  # noqa: E402
from peerstate.worker.checkpoint import latest_checkpoint  # noqa: E402


def recoveries(job):
    return job.events("recovery")


@pytest.mark.parametrize("script_args", [[], ["--data-parallel"], ["--data-parallel", "--data-parallel-shares", "1"],
                                         ["--versions", "3"], ["--versions", "3", "--data-parallel"],
                                         ["--versions", "2"]],
                         ids=["replicated", "data-parallel", "data-parallel-full-copies", "eager",
                              "eager-data-parallel", "synced"])
def test_kill_one_worker_recovers_bitwise(run, reference, script_args):
    job = run(script_args=script_args)
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [recovery] = recoveries(job)
    assert recovery["failed"] == [2] and recovery["from"] == "fault"
    assert set(recovery["phases_s"]) == {"detect", "plan", "abort", "re-form", "transfer", "restore", "first step"}
    assert all(v is not None and v >= 0 for v in recovery["phases_s"].values())
    [end] = job.events("job_end")
    assert end["steps"] == STEPS and 0 < end["goodput"] < 1 and end["recoveries"] == 1
    assert end["lost_s"] >= recovery["total_s"] and end["goodput"] == pytest.approx(1 - end["lost_s"] / end["wall_s"])
    # torchrun's environment: the spare (slot 2 of node 0) has a provisional LOCAL_RANK and no
    # RANK before track(), rank 2's after; every process gets OMP_NUM_THREADS=1.
    spare_log = (job.logs / "n0.2.log").read_text()
    assert "environment before track: PEERSTATE_ROLE=spare RANK=- LOCAL_RANK=0 OMP_NUM_THREADS=1" in spare_log
    assert "environment after track: PEERSTATE_ROLE=spare RANK=2 LOCAL_RANK=0 OMP_NUM_THREADS=1" in spare_log
    assert "environment before track: PEERSTATE_ROLE=worker RANK=3 LOCAL_RANK=1 OMP_NUM_THREADS=1" in \
        (job.logs / "n1.1.log").read_text()
    assert not job.events("rng_changed_after_restore")  # the replacement's script kept its restored RNG
    memory = {m["rank"]: m for m in job.events("memory")}  # Job.memory() at the end, per rank
    assert sorted(memory) == [0, 1, 2, 3], memory
    # Each survivor said it once allocated too, at its first step: the same figures (nothing grows).
    said = {rank: [m for m in job.events("memory") if m["rank"] == rank] for rank in (0, 1, 3)}
    for rank, (start, end) in said.items():
        assert start["time"] < end["time"] and start["node_share"] > 0, said
        assert {k: start[k] for k in MEMORY_FIELDS} == {k: end[k] for k in MEMORY_FIELDS}, said
    for node, ranks in ((0, 3), (1, 2)):  # and the run's summary, per node (node 0's spare took rank 2)
        line = (rf"peerstate: node {node}: host memory a rank holds for recoveries \(the most of {ranks} ranks\): "
                r"its snapshots [\d.]+ MB \([\d.]+x what it copies a step")
        assert re.search(line, job.agent_logs[node].read_text()), job.agent_logs[node].read_text()[-3000:]
    if "--data-parallel" not in script_args:  # all of a rank's state goes to its buddy, which holds two versions
        # the synced or eager pipeline's, or the lazy one's
        versions = int(script_args[script_args.index("--versions") + 1]) if "--versions" in script_args else 4
        for m in memory.values():
            per, in_pages = m["snapshot_per_version"], -(-m["snapshot_per_version"] // mmap.PAGESIZE) * mmap.PAGESIZE
            assert per > 0 and m["snapshots_held"] == versions * in_pages, memory  # each version in whole pages
            assert m["replicas_reserved"] == 2 * per and m["replicas_held"] == 2 * in_pages, memory
    pulled = {p["rank"]: p for p in job.events("pulled")}
    if script_args[-1:] == ["--data-parallel"]:
        # Two data-parallel shares (one per rank of a node; rank r holds share r % 2). The
        # survivors pulled the share they lack, the replacement both.
        assert {r: (p["shares"], p["replacement"]) for r, p in pulled.items()} == \
            {0: ([1], False), 1: ([0], False), 2: ([0, 1], True), 3: ([0], False)}, pulled
        # Where the source shares the puller's node, chunks are read from its memory,
        # not over TCP: the spare (node 0) and rank 1 read from ranks 0 and 1, while
        # rank 3 (node 1) lost its node's copy of share 0 with rank 2.
        assert pulled[2]["same_node_sources"] == [0, 1] and pulled[2]["chunks_from_memory"] > 0, pulled
        assert pulled[1]["same_node_sources"] == [0], pulled
        assert pulled[1]["chunks_from_memory"] == pulled[1]["chunks"] > 0, pulled
        assert pulled[3]["same_node_sources"] == [] and pulled[3]["chunks_from_memory"] == 0, pulled
    elif "--data-parallel" in script_args:
        # A full copy on every rank: the survivors pull nothing; the spare (node 0) read
        # everything from ranks 0 and 1 on its node, not over TCP.
        assert list(pulled) == [2] and pulled[2]["shares"] == [0], pulled
        assert pulled[2]["same_node_sources"] == [0, 1], pulled
        assert pulled[2]["chunks_from_memory"] == pulled[2]["chunks"] > 0, pulled
    else:
        assert not pulled, pulled


@pytest.mark.parametrize("script_args", [["--seed-after-track"], ["--prefetch"]], ids=["seed", "prefetch"])
def test_a_resume_that_is_not_bitwise_is_said_on_the_console_and_in_the_summary(run, script_args):
    # track() restored the replacement's RNG; the script then re-seeded it, or drew the next
    # step's batch ahead, so the run cannot end bitwise equal to a fault-free one. Only the
    # replacement can tell (a fresh start restores nothing); its agent says so on the console
    # (the agent's stderr), at once and again in its closing summary. Exit codes stay 0.
    job = run(script_args=script_args)
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    assert job.wait() == [0, 0], job.describe()
    [warning] = job.events("rng_changed_after_restore")
    assert warning["rank"] == 2 and warning["generators"] == ["torch"], warning
    assert "and they changed before its first step (moved: torch)" in (job.logs / "n0.2.log").read_text()
    console = job.agent_logs[0].read_text()  # rank 2's replacement is node 0's spare
    said = re.findall(r"rank 2 \(n0\.2\) at step \d+: this run is no longer bitwise equal to a fault-free one: it "
                      r"was restored to step \d+ inside track\(\), RNG states included", console)
    assert len(said) == 2, console  # at once, and in the summary
    assert "node 0's ranks finished, but the run is not bitwise equal to a fault-free one (1 finding(s)" in console
    assert "not bitwise" not in job.agent_logs[1].read_text()


def test_under_strict_a_resume_that_is_not_bitwise_stops_the_job(run):
    job = run(script_args=["--seed-after-track"], agent_args=[*FAST, "--strict"])
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    assert job.wait() == [1, 1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert "the job cannot go on: --strict: rank 2 (n0.2)" in summary and "no longer bitwise" in summary, summary


def test_a_process_group_timeout_past_the_abort_bounds_is_kept_and_said(run):
    # torchtitan sets every group's timeout after its first step (100 s by default); a gloo
    # collective that waited that long would hold the loop past the abort deadline. Kept at
    # the bound (Job(abort_timeout=30) / 2), said on the console at once and in the summary.
    job = run(script_args=["--pg-timeout", "3600"])
    assert job.wait() == [0, 0], job.describe()
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        console = job.agent_logs[node].read_text()
        # the call the script made: torch.distributed.set_timeout from torch 2.14, _set_pg_timeout before
        said = re.findall(r"rank (\d) \(n\d\.\d\) at step \d+: peerstate overrode a call of the script: torch\."
                          r"distributed\.(?:set_timeout|distributed_c10d\._set_pg_timeout)\(3600s\) on process group "
                          r"'0' was kept at 15s", console)
        assert sorted(said) == sorted(2 * [str(r) for r in ranks]), console  # at once, and in the summary
        assert f"node {node}'s ranks finished, but peerstate overrode calls of the script (2 finding(s)" in console
    job = run(script_args=["--pg-timeout", "3600"], agent_args=[*FAST, "--strict"])
    assert job.wait() == [1, 1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert "the job cannot go on: --strict: rank" in summary and "was kept at 15s" in summary, summary


def test_a_collective_between_two_guarded_steps_is_said_and_stops_a_strict_job(run):
    # A metric's all_reduce after step 1's guard: a rank failing while it runs would not be
    # recovered. Every rank says it once, at step 2's guard, on its agent's console and in
    # the summary; --strict stops the job.
    job = run(script_args=["--collective-outside-guard"])
    assert job.wait() == [0, 0], job.describe()
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        console = job.agent_logs[node].read_text()
        said = re.findall(r"rank (\d) \(n\d\.\d\) at step 2: a collective ran outside job\.guard\(\), where no "
                          r"recovery reaches it: the collectives of ranks \[0, 1, 2, 3\]", console)
        assert sorted(said) == sorted(2 * [str(r) for r in ranks]), console  # at once, and in the summary
        assert (f"node {node}'s ranks finished, but the script ran collectives outside job.guard() (2 finding(s)"
                in console), console
    job = run(script_args=["--collective-outside-guard"], agent_args=[*FAST, "--strict"])
    assert job.wait() == [1, 1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert "the job cannot go on: --strict: rank" in summary and "outside job.guard()" in summary, summary


def test_a_random_draw_between_two_guarded_steps_is_said_and_stops_a_strict_job(run, reference):
    # A draw from the global generator after each step's guard (an evaluation that samples):
    # the recovery rolls back to a step's end and goes on at the next guard without it, so the
    # run ends with other parameters than the fault-free one. Every rank says so once, at step
    # 1's guard (before any failure), on its agent's console and in the summary (rank 2's
    # replacement too, at its own second guard); --strict stops the job.
    job = run(script_args=["--draw-after-guard"])
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    assert job.wait() == [0, 0], job.describe()
    final = torch.load(job.out)
    assert any(not torch.equal(final[k], reference[k]) for k in reference), "a recovery replayed the draw?"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        console = job.agent_logs[node].read_text()
        said = re.findall(r"rank (\d) \(n\d\.\d\) at step 1: a random draw ran outside job\.guard\(\), which a "
                          r"recovery does not replay: random numbers were drawn from torch's global generator "
                          r"between the end of step 0's guard and step 1's", console)
        assert sorted(said) == sorted(2 * [str(r) for r in ranks]), console  # at once, and in the summary
        assert "the script drew random numbers outside job.guard()" in console, console
    job = run(script_args=["--draw-after-guard"], agent_args=[*FAST, "--strict"])
    assert job.wait() == [1, 1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert "the job cannot go on: --strict: rank" in summary and "random draw ran outside" in summary, summary


def test_two_failures_in_sequence_refill_the_spare_pool(run, reference):
    # Survivors pull the data-parallel share they lack at each recovery. Steps of half a
    # second: the second kill waits for the refilled spare, and for rank 3's first copy
    # after the recovery to reach its holder, the replacement of rank 1 (a kill before it
    # is the one-step window docs/recovery.md states: rank 3 would be lost), and must land before
    # the job's last step (15 s in). (Sequences of every kind, replicated state included in
    # their single-kill forms, are the soak's.)
    job = run(script_args=["--step-seconds", "0.5", "--data-parallel"])
    job.wait_for_step(1, 5)
    job.kill_rank(1)
    [first] = job.wait_for(lambda: recoveries(job), "the first recovery")
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "a refilled spare")
    job.wait_for_step(3, first["version"] + 4)  # its snapshot of a step is pushed during the next
    job.kill_rank(3)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert [r["failed"] for r in recoveries(job)] == [[1], [3]]
    # ranks 0 and 2 pulled share 1 twice, into a store of two slots
    pulls = [(p["rank"], p["shares"]) for p in job.events("pulled") if not p["replacement"]]
    assert sorted(pulls) == [(0, [1]), (0, [1]), (1, [0]), (2, [1]), (2, [1]), (3, [0])], pulls


@pytest.mark.parametrize("data_parallel", [False, True], ids=["replicated", "data-parallel"])
def test_second_failure_during_a_recovery(run, reference, data_parallel):
    # With data-parallel shares, rank 1 holds the share that ranks 0 and the replacement pull.
    job = run(nodes=[(2, 1), (2, 1)], script_args=["--data-parallel"] if data_parallel else [])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    job.wait_for(lambda: job.events("plan"), "the first plan")
    job.kill_rank(1)  # while the job recovers from the first failure
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    plans = job.events("plan")
    assert sorted(r for p in plans for r in p["failed"]) == [1, 2]


def test_hung_worker_is_detected_by_its_progress_counter(run, reference):
    # The survivors are aborted in backward's all-reduce, their gradients half made; this loop
    # zeroes them after optimizer.step(), so the replayed step would add onto them were they kept.
    job = run(script_args=["--zero-grad-after-step"])
    job.wait_for_step(3, 10)
    job.kill_rank(3, signal.SIGSTOP)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [exited] = [e for e in job.events("process_exited") if e["rank"] == 3 and e["code"] != 0]
    assert "hung" in exited["how"]


def test_a_rank_whose_heartbeat_stops_in_its_loop_prints_its_stacks_before_it_is_frozen(run, reference):
    # A rank stuck holding the GIL (as in a native call that never releases it) stops its
    # heartbeat: its agent has it print every thread's stack to its log before it is frozen
    # for its replacement and killed, so that the hang explains itself afterwards.
    job = run(script_args=["--hold-gil-at", "1:5:600"])
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [exited] = [e for e in job.events("process_exited") if e["rank"] == 1 and e["code"] != 0]
    assert exited["how"].startswith("hung (its progress counter stopped)"), exited
    log = (job.logs / f"{exited['worker']}.log").read_text()
    assert "(most recent call first)" in log and "in hold_the_gil" in log and "in train_step" in log, log[-3000:]


@pytest.mark.parametrize("script_args", [[], ["--data-parallel"]], ids=["replicated", "data-parallel"])
def test_a_hung_rank_and_its_buddy_killed_before_the_hang_is_seen_both_come_back_from_its_memory(run, reference,
                                                                                                script_args):
    # Rank 3 hangs; 0.3 s later its buddy, rank 1, is killed. Each held the other's only
    # replica, so the copies left are the hung rank's memory: its own snapshot and its
    # replica of rank 1. Its agent freezes it instead of killing it, its replacement on
    # node 1 reads both from its memory, and rank 1's replacement pulls from that one.
    # No disk checkpoint is configured: a lost state would stop the job. (With the
    # data-parallel state in shares, the shares come from the two survivors.)
    job = run(nodes=[(2, 1), (2, 1)], script_args=script_args)
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(3, 10)
    job.kill_rank(3, signal.SIGSTOP)
    time.sleep(0.3)
    job.kill_rank(1)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert not job.events("checkpoint_fallback") and not job.events("state_lost")
    [adopted] = job.events("stopped_holder_adopted")
    assert adopted["rank"] == 3 and adopted["own"] and adopted["replicas"].get("1") and not adopted["refused"], adopted
    [killed] = job.events("hung_worker_killed")
    assert killed["rank"] == 3 and killed["released"], killed
    assert sorted({r for p in job.events("plan") for r in p["failed"]}) == [1, 3]


def test_a_hung_rank_is_kept_until_its_replacement_has_replicated_so_a_second_replacement_reads_it_again(run,
                                                                                                     reference):
    # The soak's hang-then-kill-buddy fallback (seed 12, under load): rank 3 hangs and its buddy
    # rank 1 is killed; rank 3's replacement adopts what the hung worker held, and is killed in
    # its first step, before its first round reached its holder. It was released (and killed)
    # as soon as its replacement had pulled, so the only copies of rank 3 went with that
    # replacement. It is now held until a round lands: the next replacement reads it again.
    job = run(nodes=[(2, 1), (2, 2)], script_args=["--replacement-busy", "3:60"])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 3, "the spares")
    job.wait_for_step(3, 3)
    job.kill_rank(3, signal.SIGSTOP)
    time.sleep(0.3)
    job.kill_rank(1)
    job.wait_for(lambda: "rank 3's replacement busy" in job.text(), "rank 3's replacement in its first step")
    job.kill_rank(3)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert not job.events("checkpoint_fallback") and not job.events("state_lost"), job.describe()
    adopted = [e for e in job.events("stopped_holder_adopted") if e["rank"] == 3]
    assert len(adopted) == 2 and adopted[0]["pid"] == adopted[1]["pid"] and adopted[1]["own"], adopted
    [killed] = job.events("hung_worker_killed")
    assert killed["rank"] == 3 and killed["released"], killed


def test_a_replacement_frozen_while_it_recovers_is_found_by_its_liveness_and_nobody_else_exits(run, reference):
    # While a worker recovers, torch's setup collectives may hold the GIL, so its Python
    # heartbeat is bounded by --join-timeout (60 s here). Its native liveness count is not:
    # a replacement frozen in its join is found within --hang-timeout, and the members that
    # waited on it (for its report, or in the group's rendezvous, which times out first)
    # join the next epoch instead of exiting: one more plan, no other process lost.
    job = run(nodes=[(2, 1), (2, 1)])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    [assigned] = job.wait_for(lambda: [e for e in job.events("spare_assigned") if e["rank"] == 2], "a replacement")
    [pid] = [e["pid"] for e in job.events("spare_ready") if e["source"] == assigned["source"]]
    job.signal_process(pid, signal.SIGSTOP, "rank 2's replacement, in its join")
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert [p["failed"] for p in job.events("plan")] == [[2], [2]], job.describe()
    exits = [(e["rank"], e["how"]) for e in job.events("process_exited") if e["code"] != 0 and e["rank"] is not None]
    assert len(exits) == 2 and exits[1] == (2, "hung: frozen (stopped by a signal, state T) and was killed"), exits


SLEEP_SYSCALLS = {"x86_64": ("35", "230"), "aarch64": ("101", "115")}  # nanosleep, clock_nanosleep


def stop_between_watch_passes(agent):
    """SIGSTOP an agent while its watch loop sleeps between two passes (its main thread in
    a nanosleep), not part way through one: a pass stopped after it looked at one worker
    would go on to see the other's exit alone (seen under load: two plans, not one)."""
    sleeping = SLEEP_SYSCALLS.get(platform.machine())
    if sleeping is None:
        pytest.skip(f"no sleep syscall numbers for {platform.machine()}")
    for _ in range(1000):
        os.kill(agent, signal.SIGSTOP)
        while open(f"/proc/{agent}/stat").read().rsplit(") ", 1)[1][0] != "T":
            time.sleep(0.0005)
        with open(f"/proc/{agent}/syscall") as f:
            if f.read().split()[0] in sleeping:
                return
        os.kill(agent, signal.SIGCONT)
        time.sleep(0.001)
    raise AssertionError("the agent was never stopped between two passes of its watch loop in 1000 tries")


# select(2) or pselect6(2), where the fork server waits between two rounds of reaping and reporting
SELECT_SYSCALLS = {"x86_64": ("23", "270"), "aarch64": ("72",)}


def reported_by_fork_server(pids, server):
    """Whether the fork server ``server`` has reaped ``pids`` and told its agent: the
    pids are gone and the server waits in its select(2), which it enters again only
    once it has reported every child it reaped."""
    if any(os.path.exists(f"/proc/{pid}") for pid in pids):
        return False
    with open(f"/proc/{server}/syscall") as f:
        return f.read().split()[0] in SELECT_SYSCALLS[platform.machine()]


def test_two_ranks_of_a_node_lost_in_one_watch_pass_are_recovered_together(run, reference):
    # Node 1's agent is held while both its ranks are killed, so its next pass sees the two
    # exits together: one plan replaces both (there were two recoveries, one after the other).
    job = run(nodes=[(2, 0), (2, 2)])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(3, 3)
    pids = [job.pid_of(2), job.pid_of(3)]
    [server] = {int(open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()[1]) for pid in pids}  # the parent
    agent = job.agents[1].pid
    stop_between_watch_passes(agent)
    try:
        for rank, pid in zip((2, 3), pids):
            job.signal_process(pid, signal.SIGKILL, f"rank {rank}")
        job.wait_for(lambda: reported_by_fork_server(pids, server), "both deaths, reported", timeout=10)
    finally:
        os.kill(agent, signal.SIGCONT)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert [sorted(p["failed"]) for p in job.events("plan")] == [[2, 3]], job.describe()


def test_a_worker_whose_setup_holds_the_gil_is_not_taken_for_hung(run, reference):
    # Before its first step a worker's heartbeat may stand still for longer than --hang-timeout
    # (1.5 s here) without a hang: DDP's parameter check and a group's connect hold the GIL
    # while they wait for a slower peer (the soak lost whole rounds to that on 2 busy cores).
    job = run(script_args=["--hold-gil", "1:4"])
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert "held the GIL for 4.0s" in (job.logs / "n0.1.log").read_text()
    assert not recoveries(job) and not job.events("failure_detected"), job.describe()


def test_blocked_collectives_of_declared_subgroups_are_aborted(run, reference):
    # Rank 3 stops before its collective with rank 1, then its whole node freezes:
    # nothing exits and no socket closes, as when a node drops off the network.
    # Rank 1, blocked on rank 3 in a declared subgroup whose timeout is 600 s, gets
    # out only through peerstate's abort once node 1's lease expires. Afterwards both
    # subgroups are formed again and their sums checked at every step.
    job = run(script_args=["--subgroups", "--hold", "3:5"])
    job.wait_for(lambda: job.spare_pids(), "the spare")
    job.wait_for(lambda: "rank 3 holds at step 5" in job.text(), "rank 3's stop")
    job.freeze_node(1, ranks=[2, 3])
    job.wait_for(lambda: recoveries(job), "the recovery")
    job.kill_node(1)  # the frozen processes: the job went on without them
    codes = job.wait()
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, job.describe()
    assert_bitwise(job, reference)
    [plan] = job.events("plan")
    assert plan["failed"] == [2, 3] and "node 1 lost" in plan["reason"]


def test_a_group_created_outside_peerstate_stops_the_job_before_its_first_step(run):
    # A group from torch.distributed.new_group would be neither aborted nor re-formed:
    # a recovery would hang on it or leave it dead. Refused at once, naming the fix.
    job = run(nodes=[(2, 0)], steps=5, script_args=["--undeclared-group"])
    assert job.wait() != [0], job.describe()
    text = job.text() + "".join(log.read_text() for log in job.agent_logs)
    assert "process groups were created outside peerstate: ranks [0, 1]." in text, job.describe()
    assert "the job cannot go on" in text, job.describe()  # the job stops: no spare is sent into the same error
    assert "job.new_group(ranks) or job.device_mesh(...) before track()" in text
    assert not re.search(r"^rank \d step 0", job.text(), re.M), "a step ran with an undeclared group"


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_script_that_forms_its_own_default_group_is_told_what_to_remove(run, when):
    job = run(nodes=[(2, 0)], steps=5, script_args=["--init-process-group", when])
    assert job.wait() != [0], job.describe()
    summary = "".join(log.read_text() for log in job.agent_logs)
    if when == "after":
        assert "init_process_group() was called after peerstate.Job()" in summary, job.describe()
    else:  # under peerstate run, rank 0's init_process_group fails: MASTER_PORT is the job's store
        assert "It failed in init_process_group()" in summary, job.describe()
    assert "remove the script's torch.distributed.init_process_group() call" in summary, job.describe()
    assert "Job(backend=...)" in summary


def test_a_long_step_without_a_failure_is_not_lost_time(run):
    # Rank 0 spends 2 s in step 5 (an evaluation), within the collective timeout: goodput
    # counts only time lost to failures, so this run's is 100% (the old measure, steps x
    # median step / wall, said ~50%).
    job = run(nodes=[(2, 0), (2, 0)], script_args=["--busy", "0:5:2"])
    assert job.wait() == [0, 0], job.describe()
    [end] = job.events("job_end")
    assert (end["goodput"], end["lost_s"], end["recoveries"]) == (1.0, 0.0, 0), end
    assert end["wall_s"] > 2 + STEPS * end["median_step_s"] * 0.5, end


def test_a_busy_rank_is_not_a_dead_rank(run, reference):
    # Rank 0 spends 3 s alone in step 6 (an evaluation) while the others wait in DDP's
    # allreduce, whose gloo timeout is abort_timeout / 2 = 2 s: the job regroups with a
    # 4 s timeout, replays step 6 (3 s again) and ends bitwise, every process still its own.
    job = run(script_args=["--busy", "0:6:3", "--abort-timeout", "4", "--failure-grace", "2"])
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [regroup] = job.events("regroup")
    assert (regroup["waited"], regroup["collective_timeout"], regroup["step"]) == (2.0, 4.0, 6), regroup
    assert regroup["not_timed_out"] == [0], regroup  # the rank the others waited for
    [recovery] = recoveries(job)
    assert recovery["failed"] == [], recovery
    assert not job.events("spare_assigned"), job.describe()  # nobody was replaced
    assert all(e["code"] == 0 for e in job.events("process_exited")), job.describe()
    summary = "".join(log.read_text() for log in job.agent_logs) + job.text()
    assert "Job(abort_timeout=4) / 2" in summary and "collective timeout of 4s" in summary, job.describe()
    assert "ranks [0] had not reached it" in summary, job.describe()


def test_members_that_wait_for_a_slow_member_put_no_load_on_the_jobs_store(run, reference):
    # Rank 0 is alone in a 4 s evaluation in step 6 when rank 2 is killed: the others and
    # rank 2's replacement report at once and wait for rank 0's report for the rest of it.
    # They wait on their agents' node channels, the job's failure included: each member's
    # requests to the job's store in the recovery are the few docs/recovery.md lists,
    # however long the wait. (They polled the job's failure there every 50 ms: ~80 a member.)
    job = run(script_args=["--busy", "0:6:4"])
    job.wait_for(lambda: "rank 0 busy for 4.0s in step 6" in job.text(), "rank 0's evaluation")
    job.kill_rank(2)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [recovery] = recoveries(job)
    assert recovery["failed"] == [2], recovery
    counts = {e["rank"]: e["job_store"] for e in job.events("store_requests")}
    assert sorted(counts) == [0, 1, 2, 3], job.describe()
    # The replacement: its buddies' replica sizes and the DDP layout (a wait and a read each),
    # its own size, the job's start. A survivor: the DDP layout, by one survivor a node. The
    # marks went to the agents, which publish them one entry a node.
    assert counts[2] <= 8, counts
    survivors = [counts[r] for r in (0, 1, 3)]
    assert sorted(survivors) == [0, 1, 1] and counts[3] == 1, counts
    assert recovery["marks"].keys() == {"0", "1", "2", "3"}, recovery
    # The spare waited for its rank on its node channel too: its registration was all.
    [assigned] = job.events("spare_assigned")
    assert assigned["job_store"] == 2, assigned


def test_a_rank_killed_after_its_last_step_ends_the_job_normally(run, reference):
    job = run(script_args=["--sleep-after-loop", "3"])
    job.wait_for(lambda: "rank 2 done at step 40" in job.text(), "rank 2 to finish its loop")
    job.kill_rank(2)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert [e["rank"] for e in job.events("exited_after_last_step")] == [2], job.describe()
    assert not job.events("failure_detected") and not recoveries(job)
    summary = "".join(log.read_text() for log in job.agent_logs)
    assert "rank 2 (n1.0) was killed by SIGKILL after its last step" in summary, summary


def test_the_store_host_waits_for_a_node_whose_finished_rank_is_slow_to_exit(run, reference):
    # Rank 2 (node 1) lingers after its loop, past the lease timeout + 10 s the host once
    # waited: node 0, done first, must keep the store up until node 1 is done too (a CI
    # run under load saw node 1 "lose the store" when its rank's close() was slow).
    job = run(script_args=["--sleep-after-loop", "20", "--sleep-after-loop-rank", "2"])
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert [e["source"] for e in job.events("agent_done")] == ["agent0", "agent1"], job.describe()
    assert not job.events("failure_detected") and not recoveries(job)


def test_a_failure_after_other_ranks_finished_stops_at_once_and_says_why(run):
    # Rank 2 stops after the collectives of the last step, so the others finish and leave
    # their loop: its replay would need them. The job stops at once, not at the join timeout.
    job = run(script_args=["--hold-after", f"2:{STEPS - 1}"])
    job.wait_for(lambda: "rank 0 done at step 40" in job.text(), "rank 0 to finish its loop")
    job.wait_for(lambda: "rank 2 holds after step" in job.text(), "rank 2 to hold")
    job.kill_rank(2)
    assert job.wait(timeout=30) == [1, 1], job.describe()
    summary = "".join(log.read_text() for log in job.agent_logs)
    assert "had finished their last step: they have left the training loop" in summary, summary
    assert not recoveries(job)


def test_a_rank_lost_before_its_first_boundary_stops_the_job_at_once_and_says_why(run):
    # Rank 1 stops after step 0's collectives, before its first boundary (which publishes the
    # size of its state and sends its first copy); rank 3, its buddy, waits for that size at its
    # own first boundary. A kill of rank 1 used to leave rank 3 in that wait until its abort
    # deadline, and the job with it; the new epoch now ends the wait, every member reports, and
    # the job stops at once: rank 1's state has no copy yet (and there is no checkpoint).
    job = run(script_args=["--hold-after", "1:0", "--abort-timeout", "20"])
    job.wait_for(lambda: "rank 1 holds after step 0" in job.text(), "rank 1 to hold")
    job.kill_rank(1)
    assert job.wait(timeout=60) == [1, 1], job.describe()
    summary = "".join(log.read_text() for log in job.agent_logs)
    assert "rank 1 has no committed copy on any holder yet" in summary, summary
    assert [p["failed"] for p in job.events("plan")] == [[1]], job.describe()
    assert not job.events("abort_deadline_missed"), job.describe()


def test_a_loop_that_cannot_leave_its_call_gives_its_rank_to_a_spare(run, reference):
    # Rank 0 sleeps at step 5 (as in a call no abort can wake) while rank 3 is killed.
    # The others wait for rank 0 in the new epoch; after abort_timeout rank 0 exits on
    # its own and a second spare takes its rank.
    job = run(nodes=[(2, 1), (2, 1)], script_args=["--hold", "0:5", "--abort-timeout", "3"])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for(lambda: "rank 0 holds at step 5" in job.text(), "rank 0's stop")
    job.kill_rank(3)
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    assert [p["failed"] for p in job.events("plan")] == [[3], [0]]
    [missed] = job.events("abort_deadline_missed")
    assert missed["rank"] == 0 and missed["epoch"] == 1
    exits = [e["code"] for e in job.events("process_exited") if e["rank"] == 0 and e["code"] != 0]
    assert exits == [ABORT_DEADLINE_EXIT_CODE]


@pytest.mark.parametrize("script_args", [[], ["--data-parallel"], ["--versions", "2"]],
                         ids=["replicated", "data-parallel", "synced"])
def test_whole_node_killed(run, reference, script_args):
    job = run(script_args=script_args)
    job.wait_for(lambda: job.spare_pids(), "the spare")
    job.wait_for_step(2, 10)
    job.kill_node(1)
    codes = job.wait()
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, job.describe()
    assert_bitwise(job, reference)
    plans = job.events("plan")
    assert sorted(r for p in plans for r in p["failed"]) == [2, 3]
    assert "node 1 lost" in plans[0]["reason"]


def test_the_node_that_hosts_the_tcpstore_lost_stops_the_others_saying_so(run):
    # The embedded TCPStore is node 0's: the one loss it does not survive (etcd does, see
    # test_replicated_store). Node 1 must say the store went, not fail on some other error.
    job = run()
    job.wait_for(lambda: job.spare_pids(), "the spare")
    job.wait_for_step(2, 5)
    job.kill_node(0)
    codes = job.wait()
    assert codes == [-signal.SIGKILL, 1], job.describe()
    summary = job.agent_logs[1].read_text()
    assert "the job cannot go on: node 1 lost" in summary and "hosted by node 0's agent" in summary, summary
    assert "agent failed" not in summary and "Traceback" not in summary, summary
    assert not job.leftover_processes()


def test_rank_and_its_only_buddy_lost_stops_the_job_cleanly(run):
    job = run(nodes=[(2, 2), (2, 0)])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "both spares")
    job.wait_for_step(2, 10)
    job.kill_rank(0)
    job.kill_rank(2)  # rank 0's only buddy (k=1)
    codes = job.wait()
    assert codes == [1, 1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert "ranks 0 and 2 lost" in summary and "shard of rank 0 has no surviving copy" in summary, summary
    assert "cannot go on" in summary


@pytest.mark.parametrize("killed, data_parallel", [([0, 2], True), ([0, 1, 2, 3], False)],
                         ids=["data-parallel", "every-rank"])
def test_rank_and_its_only_buddy_lost_falls_back_to_the_disk_checkpoint(run, reference, tmp_path, killed,
                                                                        data_parallel):
    # "every-rank": no survivor is left to publish the DDP bucket layouts either; the
    # replacements take them from the checkpoint (they waited for them until join_timeout).
    checkpoints = tmp_path / "checkpoints"
    job = run(nodes=[(2, 2), (2, len(killed) - 2)], script_args=["--data-parallel"] if data_parallel else [],
              agent_args=FAST + ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "5"])
    job.wait_for(lambda: len(job.events("spare_ready")) >= len(killed), "the spares")
    job.wait_for_step(2, 12)
    for rank, pid in [(rank, job.pid_of(rank)) for rank in killed]:  # back to back, the pids found first
        job.signal_process(pid, signal.SIGKILL, f"rank {rank}")
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [fallback] = {e["step"]: e for e in job.events("checkpoint_fallback")}.values()
    # Usually every rank is declared in one plan, and the fallback names them all; under load a node's
    # ranks may be planned for before the other node's are killed, and the fallback then names those
    # whose every copy was lost after it (the first ones' replacements held nothing yet).
    named = {int(r) for r in re.match(r"ranks? ((?:\d+(?: and )?)+) lost", fallback["message"]).group(1).split(" and ")}
    declared = {rank for plan in job.events("plan") for rank in plan["failed"]}
    assert fallback["step"] % 5 == 0 and named <= set(killed) and declared >= set(killed), (fallback, declared)
    # The holders dropped the abandoned run's replicas too: the re-run's versions landed
    # (the soak found every push refused as "not newer" up to the step of the failure).
    refused = [e for e in job.events("replication_failed") if "not newer" in e["error"]]
    assert not refused, refused
    if data_parallel:  # ranks 0 and 2 were the two holders of data-parallel share 0
        assert "data-parallel share 0 has no surviving copy" in fallback["message"], fallback


def test_a_checkpoint_a_replacement_cannot_load_stops_the_job_instead_of_taking_spare_after_spare(run, tmp_path):
    # Rank 0's file of the newest checkpoint is torn under a .metadata that calls it complete
    # (how a replayed save once left one, before complete checkpoints were left alone). Ranks 0
    # and 2 are then lost together: the fallback's replacement of rank 0 cannot load it, and
    # neither could any other; the job stops saying why, with no plan past the two losses.
    checkpoints = tmp_path / "checkpoints"
    job = run(nodes=[(2, 2), (2, 0)], script_args=["--data-parallel", "--step-seconds", "0.3"],
              agent_args=FAST + ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "10"])
    job.wait_for(lambda: len(job.events("spare_ready")) >= 2, "the spares")
    job.wait_for_step(2, 12)  # checkpoint 10 is complete; 20 is 8 steps (2.4 s) away
    step, path = latest_checkpoint(str(checkpoints))
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as torn:
        torn.truncate(100)
    job.kill_rank(0)
    job.kill_rank(2)
    assert job.wait() == [1, 1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert f"rank 0 could not load the disk checkpoint {path}" in summary, summary
    assert sorted(r for p in job.events("plan") for r in p["failed"]) == [0, 2] and step == 10, job.describe()


def test_a_rank_that_dies_of_an_exception_in_its_loop_is_recovered(run, reference):
    # Job.close() (atexit, after the exception) used to mark its progress counter finished,
    # and the agent then took the death for one after the last step: not recovered. And the
    # guard used to wait failure_grace (20 s here) for a plan before raising the script's own
    # error, while the others waited in their all-reduce until gloo timed it out (15 s here);
    # now it raises at once and the others are aborted as for a kill, not timed out.
    # The loop is the decorator's form (job.guarded): the error leaves through it, and the
    # others' interrupted calls return None and are replayed.
    job = run(script_args=["--raise-at", "1:8", "--step-function"])
    assert job.wait() == [0, 0], job.describe()
    assert_bitwise(job, reference)
    [recovery] = recoveries(job)
    assert recovery["failed"] == [1] and "exited with code 1" in recovery["reason"], recovery
    assert "was told to fail in step 8" in (job.logs / "n0.1.log").read_text()
    [raised] = job.events("step_raised")
    assert raised["rank"] == 1 and raised["step"] == 8 and "told to fail" in raised["error"], raised
    interrupted = job.events("step_interrupted")
    assert interrupted and not [e for e in interrupted if "Timed out" in (e["error"] or "")], interrupted


def test_a_script_error_that_every_replacement_meets_again_stops_the_job_loudly(run):
    # Each replacement replays the step and raises again: without the count, the job handed the
    # rank to every spare in turn (refilled, with the fork server, in about a second) for ever.
    job = run(nodes=[(2, 2), (2, 0)], steps=10_000, script_args=["--raise-at", "1:8:always"])
    assert job.wait() == [1, 1], job.describe()
    raised = job.events("step_raised")
    assert [(e["rank"], e["step"]) for e in raised] == [(1, 8)] * 3, raised
    summary = job.agent_logs[0].read_text()
    assert "in step 8, and 3 of its workers have now raised there" in summary and "rank 1 was told to fail in step 8" \
        in summary, summary
    assert len(job.events("plan")) == 2, job.describe()  # the first two errors were recovered from


def test_a_recovery_that_raises_in_every_replacement_stops_the_job_loudly(run):
    # A replacement whose restore raises exits, and the next spare runs the same restore:
    # without the count the job used up its spares, refilled, for ever, each said only as
    # "exited with code 1". Each exits at once: its own load_state_dict raising is no
    # peer's failure (it waited failure_grace for a plan, here long past the job's bound).
    job = run(nodes=[(2, 2), (2, 0)], steps=10_000,
              script_args=["--raise-in-restore", "1", "--failure-grace", "600"])
    job.wait_for_step(1, 5)
    job.kill_rank(1)
    assert job.wait() == [1, 1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert "the restore of rank 1 was told to fail in its recovery" in summary and \
        "3 of its workers have now raised there" in summary, summary
    # The kill's epoch, then one for each of the first two replacements that raised.
    assert [e["epoch"] for e in job.events("plan")] == [1, 2, 3], job.describe()


def test_a_new_job_resumes_from_the_newest_checkpoint_of_the_same_directory(run, reference, tmp_path):
    # A first job stops after step 19 (checkpoints of steps 0, 5, 10 and 15); a new job with the
    # same --checkpoint-dir goes on at step 16 and ends as the fault-free 40-step run, bit for bit.
    checkpoints = ["--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "5"]
    first = run(nodes=[(2, 0), (2, 0)], steps=20, agent_args=FAST + checkpoints)
    assert first.wait() == [0, 0], first.describe()
    second = run(nodes=[(2, 0), (2, 0)], agent_args=FAST + checkpoints)
    assert second.wait() == [0, 0], second.describe()
    assert_bitwise(second, reference)
    resumed = second.events("resumed")
    assert sorted(e["rank"] for e in resumed) == [0, 1, 2, 3] and {e["step"] for e in resumed} == {15}, resumed
    first_steps = re.findall(r"^rank 0 step (\d+)", second.text(), re.M)
    assert first_steps[0] == "16", first_steps[:3]
    assert "resumed from the disk checkpoint of step 15" in second.text(), second.describe()


def test_a_checkpoint_that_does_not_fit_the_new_job_stops_it_with_what_to_do(run, tmp_path):
    checkpoints = ["--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "5"]
    first = run(nodes=[(2, 0)], steps=6, agent_args=FAST + checkpoints)
    assert first.wait() == [0], first.describe()
    second = run(nodes=[(2, 0)], steps=12, agent_args=FAST + checkpoints, script_args=["--width", "32"])
    assert second.wait() == [1], second.describe()
    summary = second.agent_logs[0].read_text()
    assert "could not load the disk checkpoint" in summary and "step_000000005: " in summary, summary
    assert "Size mismatch" in summary, summary  # DCP's cause, not its traceback
    assert "give the job another --checkpoint-dir" in summary, summary
    assert not re.search(r"^rank \d step", second.text(), re.M), "a step ran from a checkpoint that did not fit"


def test_fsdp2_shards_recover_bitwise(run, tmp_path_factory):
    """FSDP2 (fully_shard) over gloo: each rank snapshots and replicates its own shard; the
    replacement of rank 2 receives rank 2's shard, and every shard ends as in a fault-free run."""
    reference = Job(tmp_path_factory.mktemp("fsdp-reference"), [(4, 0)], steps=STEPS, script_args=["--fsdp"])
    try:
        assert reference.wait() == [0], reference.describe()
    finally:
        reference.close()
    job = run(script_args=["--fsdp"])
    job.wait_for_step(2, 10)
    job.kill_rank(2)
    assert job.wait() == [0, 0], job.describe()
    for rank in range(4):
        expected = torch.load(f"{reference.out}.rank{rank}")
        final = torch.load(f"{job.out}.rank{rank}")
        different = [k for k in expected if not torch.equal(final[k], expected[k])]
        assert not different, f"rank {rank}: shards {different} differ from the fault-free run"
    [recovery] = recoveries(job)
    assert recovery["failed"] == [2]


def test_a_data_parallel_rank_of_a_two_node_job_opens_one_replication_port(tmp_path):
    # The replication servers listen at --host (127.0.0.2 here); gloo listens on lo's 127.0.0.1.
    # With 2 ranks per node there are 2 data-parallel shares: one server serves them and the rank's own state.
    job = Job(tmp_path, [(2, 0), (2, 0)], steps=6, agent_args=["--host", "127.0.0.2"],
              script_args=["--data-parallel", "--report-ports"])
    try:
        assert job.wait() == [0, 0], job.describe()
        counts = sorted(re.findall(r"^rank (\d) listens on (\d+) ports at 127\.0\.0\.2$", job.text(), re.M))
        assert counts == [("0", "1"), ("1", "1"), ("2", "1"), ("3", "1")], job.describe()
    finally:
        job.close()


def test_state_that_cannot_fit_the_nodes_memory_stops_the_job_before_it_is_allocated(run, monkeypatch):
    # A node said to have 1 MiB for its 2 ranks: a share of 512 KiB holds not even the 4 versions of
    # a rank's own state (each reserves 256 KiB for its objects). Every rank would refuse the same, so
    # the job stops at the first step, saying what to do, instead of handing the rank to the spare.
    monkeypatch.setenv("PEERSTATE_HOST_MEMORY", "1M")  # the agents, and so their workers, inherit it
    job = run(nodes=[(2, 1)])
    assert job.wait() == [1], job.describe()
    summary = job.agent_logs[0].read_text()
    assert "cannot hold its state for recoveries in this node's memory: 4 versions of its own state" in summary, \
        summary
    assert "over its share of 512 KiB (1.0 MiB from the node's PEERSTATE_HOST_MEMORY, for 2 ranks)" in summary, \
        summary
    assert "Spread the state over more ranks or nodes (FSDP" in summary, summary
    assert not job.events("spare_assigned"), job.describe()
    assert not re.search(r"^rank \d step 1\b", job.text(), re.M), "a step ran past the refusal"

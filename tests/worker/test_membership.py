"""The member lifecycle (which transitions are allowed, what needs_state says, how the
step counter moves), and a spare's wait for its rank on the node channel."""

import threading

import pytest

from peerstate import InternalError, JobFailedError
from peerstate.control import keys
from peerstate.control.memory_store import InMemoryKeyValueStore
from peerstate.control.messages import RecoveryPlan
from peerstate.worker.membership import MemberState, Membership, allowed, job_failure, wait_for_assignment

S = MemberState


@pytest.mark.parametrize("current,new", [
    (S.SPARE, S.JOINING), (S.JOINING, S.ACTIVE), (S.JOINING, S.NEEDS_STATE), (S.JOINING, S.JOINING),
    (S.NEEDS_STATE, S.ACTIVE), (S.NEEDS_STATE, S.JOINING), (S.ACTIVE, S.RECOVERING), (S.ACTIVE, S.JOINING),
    (S.ACTIVE, S.FINISHED), (S.RECOVERING, S.JOINING), (S.FINISHED, S.CLOSED), (S.SPARE, S.CLOSED),
])
def test_allowed_transitions(current, new):
    assert allowed(current, new)


@pytest.mark.parametrize("current,new", [
    (S.SPARE, S.ACTIVE), (S.SPARE, S.RECOVERING), (S.NEEDS_STATE, S.RECOVERING), (S.RECOVERING, S.ACTIVE),
    (S.FINISHED, S.JOINING), (S.CLOSED, S.ACTIVE), (S.ACTIVE, S.NEEDS_STATE), (S.JOINING, S.FINISHED),
])
def test_refused_transitions(current, new):
    assert not allowed(current, new)
    member = Membership("n0.0", spare=False)
    member.state = current
    with pytest.raises(InternalError, match=f"from {current.value} to {new.value}"):
        member.move(new)


def test_a_spare_joins_without_state_until_restored():
    member = Membership("n0.2", spare=True)
    assert member.needs_state
    assert member.begin_join() is True
    member.end_join()
    assert member.state is S.NEEDS_STATE and member.needs_state
    member.restored()
    assert member.state is S.ACTIVE and not member.needs_state


def test_a_replacement_restored_during_its_join_ends_it_active():
    member = Membership("n0.2", spare=True)
    member.begin_join()
    member.restored()  # the pull ran beside the re-forming of the group
    assert member.state is S.JOINING and not member.needs_state
    member.end_join()
    assert member.state is S.ACTIVE


def test_a_superseded_join_keeps_what_the_member_lacks():
    member = Membership("n0.2", spare=True)
    member.begin_join()
    assert member.begin_join() is True  # joined again before any restore
    survivor = Membership("n0.0", spare=False)
    assert survivor.begin_join() is False
    survivor.end_join()
    survivor.move(S.RECOVERING)
    assert survivor.begin_join() is False and survivor.state is S.JOINING


def test_the_step_counter_moves_by_clean_steps_rollbacks_and_a_resume_only():
    survivor = Membership("n0.0", spare=False)
    survivor.begin_join()
    survivor.end_join()
    for step in range(5):
        survivor.step_done(step)
    assert survivor.next_step == 5
    with pytest.raises(InternalError, match="step 3 ended, but step 5 was the one to run"):
        survivor.step_done(3)  # a step counted twice
    with pytest.raises(InternalError, match="active, not joining, rolled back"):
        survivor.rolled_back_to(2)  # only a join rolls back
    survivor.move(S.RECOVERING)
    survivor.begin_join()
    # Steps 3 and 4 completed after recovery point 2's own step (3 is the recovery's): 4 runs again.
    assert survivor.rolled_back_to(2) == 1 and survivor.next_step == 3
    with pytest.raises(InternalError, match="a resume at step 7 after step 2 ran"):
        survivor.resumed_at(7)  # a disk resume is a new job's, before its first step
    replacement = Membership("n1.2", spare=True)
    replacement.begin_join()
    assert replacement.rolled_back_to(2) == 0 and replacement.next_step == 3  # forward: nothing replayed
    fresh = Membership("n0.1", spare=False)
    fresh.resumed_at(40)
    assert fresh.next_step == 40


def _plan(epoch, replaced):
    return RecoveryPlan(epoch, {}, replaced, sorted(replaced), "killed", 1.0, 2.0).encode()


def test_a_spare_finds_its_rank_in_the_plans_its_agent_copies_in_order_and_its_certificate_beside():
    channel = InMemoryKeyValueStore()
    channel.set(keys.epoch_plan(1), _plan(1, {2: "n0.2"}))  # another spare's epoch
    found = []
    waiter = threading.Thread(target=lambda: found.append(
        wait_for_assignment(channel.clone(), "n1.2", timeout=30, poll=0.05)))
    waiter.start()
    channel.set(keys.epoch_plan(2), _plan(2, {5: "n0.3"}))
    channel.set_many([(keys.rank_certificate("n1.2", 1), b"its certificate"),
                      (keys.epoch_plan(3), _plan(3, {1: "n1.2", 6: "n0.4"}))])
    waiter.join(timeout=10)
    [(plan, rank, certificate)] = found
    assert (plan.epoch, rank, certificate) == (3, 1, b"its certificate")


def test_a_waiting_spare_leaves_once_its_agent_copied_the_jobs_failure():
    channel = InMemoryKeyValueStore()
    assert job_failure(channel) is None
    channel.set(keys.JOB_FAILED, b"rank 3 and its only buddy were lost")
    assert job_failure(channel) == "rank 3 and its only buddy were lost"
    with pytest.raises(JobFailedError, match="while this spare waited: rank 3 and its only buddy were lost"):
        wait_for_assignment(channel, "n1.2", timeout=30, poll=0.05)

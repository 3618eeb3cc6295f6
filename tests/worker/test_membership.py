"""The member lifecycle: which transitions are allowed, and what needs_state says."""

import pytest

from peerstate import InternalError
from peerstate.worker.membership import MemberState, Membership, allowed

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

import pytest

from helpers.wire_client import Rig


@pytest.fixture
def rig():
    """A holder with a committed replica and its own snapshot, checked intact by the tests."""
    r = Rig()
    yield r
    r.close()

import os
import random

import numpy as np
import pytest


@pytest.fixture
def rng():
    seed = int(os.environ.get("PEERSTATE_TEST_SEED", "1234"))
    random.seed(seed)
    return np.random.default_rng(seed)


@pytest.fixture
def store():
    import peerstate

    s = peerstate.SnapshotStore(threads=2, chunk_bytes=64 * 1024)
    yield s
    s.close()

import os
import random

import numpy as np
import pytest

# FutureWarning is an error here (pyproject.toml's filterwarnings) and in every process the tests
# start, which inherit this: agents, fork servers, workers, the members of multi-process tests.
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), "error::FutureWarning"]))


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


# Tests that start whole jobs (agents, workers, spares, etcd) live in these folders;
# `pytest -m "not e2e"` leaves them out (pyproject.toml registers the marker).
E2E_FOLDERS = {"e2e", "integrations"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name in E2E_FOLDERS:
            item.add_marker(pytest.mark.e2e)

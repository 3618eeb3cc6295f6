"""The core names its threads (``csrc/common/thread_name.h``): an operator's
``top -H`` and ``bench/overhead.py --breakdown`` tell the snapshot copy apart
from the training thread and from gloo's."""

import os
import sys

import numpy as np
import pytest

import peerstate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def thread_names():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # ended meanwhile
            pass
    return names


def test_the_snapshot_copy_threads_are_named_ps_copy():
    with peerstate.SnapshotStore() as store:
        store.register("weights", np.arange(1 << 20, dtype=np.float32))
        store.snapshot(0).wait()
        copiers = [n for n in thread_names() if n == "ps-copy"]
        assert copiers, thread_names()

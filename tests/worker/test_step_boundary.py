"""What the step boundary does besides snapshots: the memory a recovery freed is
handed back to the system once its first step is done."""

import subprocess
import sys

import pytest

FRAGMENTED_HEAP = """
from peerstate.tools.local import resident_bytes
from peerstate.worker.step_boundary import release_freed_memory
import os
# 64 MiB in 1 KiB chunks (malloc's, not pymalloc's), one in 64 kept: the heap cannot shrink from its top.
chunks = [bytearray(1024) for _ in range(65536)]
kept = chunks[::64]
del chunks
before = resident_bytes(os.getpid())
release_freed_memory()
print(before, resident_bytes(os.getpid()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_memory_freed_among_live_objects_goes_back_to_the_system():
    run = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    before, after = map(int, run.stdout.split())
    assert before - after > 32 * 2**20, (before, after)  # most of the 63 MiB freed

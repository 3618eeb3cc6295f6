"""Load a test puts on the machine itself: busy cores, and real cgroups (a CPU quota,
a freezer) made under this machine's cgroup mounts and removed afterwards. A test
that needs a cgroup it cannot make here is skipped, saying which."""

import contextlib
import os
import subprocess
import sys
import time
import uuid

import pytest

BURN = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end: pass\n"


@contextlib.contextmanager
def busy_cores(count, seconds=600.0):
    """``count`` processes that each keep a core busy (each ends by itself after
    ``seconds``, and is killed on leaving)."""
    burners = [subprocess.Popen([sys.executable, "-c", BURN, str(seconds)]) for _ in range(count)]
    try:
        yield burners
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def _cgroup2_mount():
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return fields[4]
    return None


class Cgroup:
    """A cgroup of one hierarchy, made for a test: ``add`` moves a process in."""

    def __init__(self, root, version):
        self.version = version
        self.path = os.path.join(root, f"peerstate-test-{uuid.uuid4().hex[:10]}")
        os.mkdir(self.path)
        self._root = root

    def write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read().strip()

    def add(self, pid):
        self.write("cgroup.procs", str(pid))

    def remove(self):
        """Hand back what is left in it to the hierarchy's root, then remove it."""
        with contextlib.suppress(OSError):
            for pid in self.read("cgroup.procs").split():
                with contextlib.suppress(OSError), open(os.path.join(self._root, "cgroup.procs"), "w") as f:
                    f.write(pid)
        for _ in range(50):  # a process that just exited may still count as a member for a moment
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.02)


class Freezer(Cgroup):
    def freeze(self):
        self.write("cgroup.freeze", "1") if self.version == 2 else self.write("freezer.state", "FROZEN")

    def thaw(self):
        self.write("cgroup.freeze", "0") if self.version == 2 else self.write("freezer.state", "THAWED")


def _writable(root):
    return root is not None and os.path.isdir(root) and os.access(root, os.W_OK)


@contextlib.contextmanager
def freezer(version):
    """A freezer cgroup: v1's freezer hierarchy, or v2's (where a SIGKILL still ends a
    frozen process; v1 holds it until thawed)."""
    root = "/sys/fs/cgroup/freezer" if version == 1 else _cgroup2_mount()
    if not _writable(root):
        pytest.skip(f"no writable cgroup v{version} freezer here")
    group = Freezer(root, version)
    if not os.path.exists(os.path.join(group.path, "cgroup.freeze" if version == 2 else "freezer.state")):
        group.remove()
        pytest.skip(f"cgroup v{version} has no freezer here")
    try:
        yield group
    finally:
        with contextlib.suppress(OSError):
            group.thaw()
        group.remove()


@contextlib.contextmanager
def cpu_quota(quota_seconds, period_seconds):
    """A cgroup whose processes together get ``quota_seconds`` of CPU in each
    ``period_seconds`` (CFS bandwidth: v1's cpu controller, else v2's cpu.max)."""
    quota, period = int(quota_seconds * 1e6), int(period_seconds * 1e6)
    if _writable("/sys/fs/cgroup/cpu") and os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        group = Cgroup("/sys/fs/cgroup/cpu", 1)
        group.write("cpu.cfs_period_us", str(period))
        group.write("cpu.cfs_quota_us", str(quota))
    else:
        root = _cgroup2_mount()
        if not _writable(root) or "cpu" not in open(os.path.join(root, "cgroup.subtree_control")).read().split():
            pytest.skip("no writable CPU controller (cgroup v1 cpu, or v2 cpu.max) here")
        group = Cgroup(root, 2)
        group.write("cpu.max", f"{quota} {period}")
    try:
        yield group
    finally:
        group.remove()

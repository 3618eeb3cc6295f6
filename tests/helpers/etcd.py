"""The tests' etcd: ``EtcdCluster`` (peerstate.tools.etcd_cluster) once the etcd
binary is known to be there (Debian's etcd-server, which .ci/run installs):
without it the tests that need it are skipped, except under CI, where that is a
failure. The fixtures close every cluster they start."""

import os
import shutil

import pytest

from peerstate.tools.etcd_cluster import EtcdCluster as _EtcdCluster


def require_etcd() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install etcd (Debian: apt-get install etcd-server); .ci/run does")
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    return binary


def EtcdCluster(directory, members=1):  # noqa: N802 - stands for the class
    require_etcd()
    return _EtcdCluster(directory, members)

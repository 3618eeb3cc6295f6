"""A system package a test needs and the machine lacks: the test is skipped, except
under CI (``.ci/run`` installs every such package), where that is a failure."""

import os

import pytest


def missing(what: str, install: str) -> None:
    """Skip, or under CI fail, because ``what`` is not installed (``install`` says how)."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must install {what} ({install}); .ci/run does")
    pytest.skip(f"no {what} ({install})")

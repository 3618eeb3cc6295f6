"""The suite's rule on deprecations: a FutureWarning (torch's, naming an API its next
release removes) fails the test that meets it, in pytest's process and in every
process a test starts (conftest.py hands them PYTHONWARNINGS)."""

import subprocess
import sys
import warnings

import pytest


def test_a_future_warning_fails_a_test_in_this_process():
    with pytest.raises(FutureWarning):
        warnings.warn("deprecated", FutureWarning)


def test_a_future_warning_fails_a_process_a_test_starts():
    warn = subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('deprecated', FutureWarning)"],
                          capture_output=True, text=True, timeout=60)
    assert warn.returncode == 1 and "FutureWarning: deprecated" in warn.stderr, warn
    other = subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('only said', UserWarning)"],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 0 and "UserWarning: only said" in other.stderr, other

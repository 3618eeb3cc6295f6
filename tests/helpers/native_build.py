"""Builds a CMake project of the tests' own (the C++ unit tests, the device
stand-ins) with cmake's default generator, each step bounded in time and
asserted with its output."""

import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional


def cmake_build(source: Path, build: Path, configure_failed: Optional[Callable[[str], None]] = None) -> Path:
    """Configures ``source`` in ``build`` and builds it; returns ``build``.
    ``configure_failed(output)`` sees a failed configure's output first (to skip
    when a system package is missing); otherwise a failed step fails the test."""
    assert shutil.which("cmake"), "cmake is needed to build the native tests (see the README's requirements)"
    configure = subprocess.run(["cmake", "-S", str(source), "-B", str(build)], capture_output=True, text=True,
                               timeout=300)
    if configure.returncode != 0 and configure_failed is not None:
        configure_failed(configure.stdout + configure.stderr)
    assert configure.returncode == 0, configure.stdout[-4000:] + configure.stderr[-4000:]
    result = subprocess.run(["cmake", "--build", str(build), "-j2"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return build

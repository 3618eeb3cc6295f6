"""Turn tensors and arrays into the ``(pointer, nbytes, device)`` the core takes.

Supported: ``torch.Tensor`` (CPU or CUDA), ``numpy.ndarray``, any object with
``__cuda_array_interface__`` (cupy), and writable objects with the buffer
protocol (``bytearray``, ``memoryview``); ``ByteRange`` names a part of one.
Memory must be contiguous and writable, since a restore writes into it. torch
and numpy are only imported when such an object is passed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from peerstate.errors import InvalidArgumentError

HOST = -1


@dataclass(frozen=True)
class Buffer:
    """A registered region: where it is, how big, and the object that owns it."""

    ptr: int
    nbytes: int
    device: int  # CUDA device index, or HOST
    owner: Any  # kept alive while registered
    dtype: str = ""  # e.g. "torch.float32[1024,4096]": a restore into other bytes is refused
    offset: int = 0  # where the region starts in owner's memory (a ByteRange)
    extent: int = -1  # owner's size when registered (-1: nbytes)

    def moved(self) -> str | None:
        """Why ``owner`` no longer matches this region, or None if it still does."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(self.owner, torch.Tensor):
            # The hot path: one call per tensor. A tensor can only lose its memory
            # by an in-place resize or set_(), and both change data_ptr().
            if self.nbytes == 0 or self.owner.data_ptr() + self.offset == self.ptr:
                return None
        now = describe("", self.owner)
        extent = self.nbytes if self.extent < 0 else self.extent
        if now.nbytes != extent:
            return f"its size changed from {extent} to {now.nbytes} bytes"
        if now.ptr + self.offset != self.ptr:
            return "its storage moved (it was resized or reassigned in place)"
        return None


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` bytes from byte ``offset`` of ``owner`` (a tensor or array), to
    register as a buffer of its own: e.g. one share of a large tensor. The
    registration check still watches the whole of ``owner``."""

    owner: Any
    offset: int
    nbytes: int


def describe(name: str, obj: Any) -> Buffer:
    """Return the Buffer for ``obj`` or raise InvalidArgumentError naming ``name``."""
    if isinstance(obj, ByteRange):
        return _describe_range(name, obj)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _describe_tensor(name, obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _describe_cuda_array(name, obj)
    return _describe_host_buffer(name, obj)


def _describe_range(name: str, part: ByteRange) -> Buffer:
    whole = describe(name, part.owner)
    if not (0 <= part.offset and 0 < part.nbytes and part.offset + part.nbytes <= whole.nbytes):
        raise InvalidArgumentError(f"'{name}': bytes [{part.offset}, {part.offset + part.nbytes}) are not a non-empty "
                                   f"range inside its {whole.nbytes} bytes")
    return Buffer(whole.ptr + part.offset, part.nbytes, whole.device, whole.owner,
                  f"{whole.dtype} bytes [{part.offset}:{part.offset + part.nbytes}]", whole.offset + part.offset,
                  whole.nbytes if whole.extent < 0 else whole.extent)


def _describe_tensor(name: str, t: Any) -> Buffer:
    import torch

    if t.layout != torch.strided:
        raise InvalidArgumentError(
            f"tensor '{name}' has layout {t.layout}; only dense (strided) tensors can be "
            "registered: register its values/indices tensors instead"
        )
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"tensor '{name}' is not contiguous; snapshots copy raw bytes, so register a "
            "contiguous tensor (e.g. keep `t = t.contiguous()` as the live tensor)"
        )
    if t.device.type == "cpu":
        device = HOST
    elif t.device.type == "cuda":
        device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    else:
        raise InvalidArgumentError(
            f"tensor '{name}' is on device '{t.device}'; peerstate snapshots CPU and CUDA tensors"
        )
    nbytes = t.numel() * t.element_size()
    return Buffer(t.data_ptr() if nbytes else 0, nbytes, device, t, f"{t.dtype}{list(t.shape)}")


def _describe_cuda_array(name: str, a: Any) -> Buffer:
    cai = a.__cuda_array_interface__
    ptr, readonly = cai["data"]
    if readonly:
        raise InvalidArgumentError(f"CUDA array '{name}' is read-only; a restore must write into it")
    import numpy as np

    itemsize = np.dtype(cai["typestr"]).itemsize
    count = 1
    for extent in cai["shape"]:
        count *= extent
    strides = cai.get("strides")
    if strides is not None and count > 0:
        expected, contiguous = itemsize, True
        for extent, stride in reversed(list(zip(cai["shape"], strides))):
            if extent > 1 and stride != expected:
                contiguous = False
            expected *= extent
        if not contiguous:
            raise InvalidArgumentError(f"CUDA array '{name}' is not C-contiguous; register a contiguous copy")
    device = getattr(getattr(a, "device", None), "id", None)
    if device is None:
        raise InvalidArgumentError(f"cannot tell which CUDA device holds array '{name}' (no .device.id)")
    return Buffer(ptr if count else 0, count * itemsize, int(device), a, f"{np.dtype(cai['typestr'])}{list(cai['shape'])}")


def _describe_host_buffer(name: str, obj: Any) -> Buffer:
    import numpy as np

    if isinstance(obj, np.ndarray):
        array = obj
    else:
        try:
            array = np.frombuffer(memoryview(obj), dtype=np.uint8)
        except TypeError:
            raise InvalidArgumentError(
                f"cannot register '{name}' of type {type(obj).__name__}: pass a torch.Tensor, "
                "numpy.ndarray, cupy array or a writable buffer such as bytearray"
            ) from None
    if not array.flags.c_contiguous:
        raise InvalidArgumentError(f"array '{name}' is not C-contiguous; register np.ascontiguousarray(a) and use that")
    if not array.flags.writeable:
        raise InvalidArgumentError(f"array '{name}' is read-only; a restore must write into it")
    kind = f"numpy.{array.dtype}{list(array.shape)}" if array is obj else f"bytes[{array.nbytes}]"
    return Buffer(array.ctypes.data if array.nbytes else 0, array.nbytes, HOST, obj, kind)

"""peerstate._probes: the native core's utilities that the tests and benchmarks
measure or check directly. The package never imports it (tests/test_layering.py).
Errors are peerstate._C's classes."""

from typing import Any, List, Tuple

def crc32c(data: Any, crc: int = 0, implementation: str = "auto") -> int:
    """CRC32C of a buffer, continued from `crc`; implementation: auto|hardware|software
    (InvalidArgumentError for another name)."""

def crc32c_hardware_available() -> bool: ...
def available_cores() -> int:
    """The cores this process may run on (its affinity mask)."""
def measure_parallel_memcpy(
    sources: List[Tuple[int, int]], threads: int, repeats: int = 3, streaming: bool = False
) -> float:
    """Best seconds of `repeats` parallel copies of the sources into one region."""
def hmac_sha256(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA256 by the system's libcrypto (UnavailableError without one)."""
def crypto_library() -> str:
    """Where libcrypto was found ("already loaded" or a path); UnavailableError says why not."""
def frame_protection_throughput(protection: str, nbytes: int = ..., repeats: int = 5) -> float:
    """One core's bytes per second (best of `repeats`) of a frame protection's pass over `nbytes`
    ("authenticated": the AES-256-GCM tag; "encrypted": encryption too), for benchmarks."""

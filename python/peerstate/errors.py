"""The peerstate exception hierarchy, rooted at :class:`Error`.

Native calls raise these from their status codes; Python code raises them too,
so that callers catch one family whatever layer failed.
"""

from peerstate._C import (  # noqa: F401  (re-exported)
    AbortedError,
    AuthenticationError,
    BudgetExceededError,
    BusyError,
    ChecksumMismatchError,
    CudaError,
    Error,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfMemoryError,
    PeerConnectionError,
    ProtocolError,
    RegistrationMismatchError,
    TimeoutError,
    UnavailableError,
)

__all__ = [
    "AbortedError",
    "AuthenticationError",
    "BudgetExceededError",
    "BusyError",
    "ChecksumMismatchError",
    "CudaError",
    "Error",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfMemoryError",
    "PeerConnectionError",
    "ProtocolError",
    "RegistrationMismatchError",
    "TimeoutError",
    "UnavailableError",
]

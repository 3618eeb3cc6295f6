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



class JobFailedError(Error):
    """The job cannot go on (no spare left, a bad configuration); the message says why."""


class StoreUnavailableError(JobFailedError):
    """The job's store did not answer within its unavailability bound; the message
    names the store and the bound."""


class StateLostError(JobFailedError):
    """A failure took every copy of some rank's state; the message names the ranks."""


__all__ = [
    "AbortedError",
    "JobFailedError",
    "StateLostError",
    "StoreUnavailableError",
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

// Status: the one error currency of the native core.
//
// Every fallible core call returns a Status (or fills an out-parameter and
// returns a Status). A Status carries a code, which selects the Python
// exception class, and a message written for the user: it names what was
// wrong and what to do. The core never throws across its API.
#pragma once

#include <string>
#include <utility>

namespace peerstate {

// The one table of status codes. Each row: the code, the Python exception it
// raises (a subclass of peerstate.Error; bindings/errors.cc builds them from
// this table), the Python builtin it also derives from ("" for none), and what
// it means. `_C.pyi` and `peerstate/errors.py` follow it; tests/native checks
// all three against each other.
#define PEERSTATE_STATUS_CODES(X)                                                                               \
  X(kInvalidArgument, InvalidArgumentError, "ValueError", "An argument was unusable; nothing changed.")        \
  X(kNotFound, NotFoundError, "LookupError", "A version, buffer or peer that does not exist.")                 \
  X(kChecksumMismatch, ChecksumMismatchError, "", "Stored bytes failed their CRC32C; nothing was written.")    \
  X(kRegistrationMismatch, RegistrationMismatchError, "",                                                      \
    "A version's layout differs from the registered buffers; nothing was written.")                           \
  X(kBudgetExceeded, BudgetExceededError, "", "The memory budget would be exceeded; nothing was registered.") \
  X(kBusy, BusyError, "", "Conflicts with an operation in flight.")                                            \
  X(kUnavailable, UnavailableError, "", "A capability this build or machine lacks (CUDA, NCCL).")              \
  X(kCudaError, CudaError, "", "A CUDA runtime call failed.")                                                  \
  X(kTimeout, TimeoutError, "TimeoutError", "A deadline passed.")                                              \
  X(kAborted, AbortedError, "", "Cancelled by abort() or close().")                                            \
  X(kConnectionError, PeerConnectionError, "ConnectionError", "A peer closed, reset or could not be reached.") \
  X(kAuthenticationError, AuthenticationError, "", "A peer is not certified by this job.")                       \
  X(kProtocolError, ProtocolError, "", "A peer sent a malformed or out-of-bounds message.")                    \
  X(kOutOfMemory, OutOfMemoryError, "MemoryError", "An allocation failed.")                                    \
  X(kInternal, InternalError, "", "A bug in peerstate; please report it.")

enum class StatusCode : int {
  kOk = 0,
#define PEERSTATE_STATUS_ENUM(code, exception, builtin, doc) code,
  PEERSTATE_STATUS_CODES(PEERSTATE_STATUS_ENUM)
#undef PEERSTATE_STATUS_ENUM
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

#define PEERSTATE_RETURN_IF_ERROR(expr)          \
  do {                                           \
    ::peerstate::Status _peerstate_status = (expr); \
    if (!_peerstate_status.ok()) return _peerstate_status; \
  } while (0)

}  // namespace peerstate

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

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,       // caller passed something unusable; nothing changed
  kNotFound,              // a version, buffer or peer that does not exist
  kChecksumMismatch,      // stored bytes fail their CRC32C; nothing was written
  kRegistrationMismatch,  // a version's layout differs from the live registration
  kBudgetExceeded,        // the configured memory budget would be exceeded
  kBusy,                  // an operation conflicts with one in flight
  kUnavailable,           // a capability this build or machine lacks (CUDA, NCCL)
  kCudaError,             // a CUDA runtime call failed
  kTimeout,               // a deadline passed
  kAborted,               // cancelled by abort() or close()
  kConnectionError,       // a peer closed, reset or could not be reached
  kAuthenticationError,   // a peer failed the job-secret challenge
  kProtocolError,         // a peer sent a malformed or out-of-bounds message
  kOutOfMemory,           // an allocation failed
  kInternal,              // a bug in peerstate
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

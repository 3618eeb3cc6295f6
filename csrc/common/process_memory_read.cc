#include "common/process_memory_read.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace peerstate {

Status read_process_memory(pid_t pid, uintptr_t address, void* dst, size_t max, size_t* got) {
  iovec local{dst, max};
  iovec remote{reinterpret_cast<void*>(address), max};
  ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n > 0) {
    *got = static_cast<size_t>(n);
    return Status::Ok();
  }
  const int err = n == 0 ? EFAULT : errno;
  const std::string who = "process " + std::to_string(pid);
  if (err == EPERM || err == EACCES || err == ENOSYS)
    return Status(StatusCode::kUnavailable, "not permitted to read the memory of " + who + " (" +
                                                std::strerror(err) + "): see ptrace(2), ptrace_scope");
  return Status(StatusCode::kConnectionError, "cannot read the memory of " + who + ": " + std::strerror(err));
}

}  // namespace peerstate

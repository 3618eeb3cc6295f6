#include "replication/process_memory.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace peerstate {
namespace {

Status read_error(pid_t pid, int err) {
  const std::string who = "process " + std::to_string(pid);
  if (err == EPERM || err == EACCES || err == ENOSYS)
    return Status(StatusCode::kUnavailable, "not permitted to read the memory of " + who + " (" +
                                                std::strerror(err) + "): see ptrace(2), ptrace_scope");
  return Status(StatusCode::kConnectionError, "cannot read the memory of " + who + ": " + std::strerror(err));
}

}  // namespace

Status receive_from_process(pid_t pid, uintptr_t remote_region, const TransferPlan& plan) {
  const Layout& layout = *plan.meta.layout;
  uint32_t c;
  while (plan.queue->take(&c)) {
    const ChunkPlacement& chunk = layout.chunks[c];
    uintptr_t from = remote_region + chunk.offset;
    auto read = [&](unsigned char* dst, size_t max, size_t* got) {
      iovec local{dst, max};
      iovec remote{reinterpret_cast<void*>(from), max};
      ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
      if (n <= 0) return read_error(pid, n == 0 ? EFAULT : errno);
      from += static_cast<size_t>(n);
      *got = static_cast<size_t>(n);
      return Status::Ok();
    };
    uint32_t crc = 0;
    Status st = fill_chunk(layout, c, plan.region + chunk.offset, read, &crc);
    if (st.ok() && crc != plan.meta.checksums[c])
      st = Status(StatusCode::kChecksumMismatch, "chunk " + std::to_string(c) + " read from process " +
                                                     std::to_string(pid) + " failed its CRC32C");
    if (!st.ok()) {
      plan.queue->give_back(c);
      return st;
    }
    plan.queue->complete(c);
  }
  return Status::Ok();
}

}  // namespace peerstate

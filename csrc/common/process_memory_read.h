// Reading another process's memory on this machine (process_vm_readv(2)).
//
// Permitted when the caller may ptrace the process (same user; Yama's
// ptrace_scope, where present, may forbid it; a process that is not dumpable
// forbids it). Does not block beyond the copy itself; the target need not
// run (a stopped process is read as well as a running one).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace peerstate {

// Copies up to `max` bytes at `address` in process `pid` into `dst` and sets
// *got to how many (at least 1 on success). kUnavailable: not permitted (see
// above); kConnectionError: the process is gone or the address is not mapped.
Status read_process_memory(pid_t pid, uintptr_t address, void* dst, size_t max, size_t* got);

}  // namespace peerstate

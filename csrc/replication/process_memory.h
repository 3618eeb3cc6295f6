// Pulling a version straight out of the memory of a holder on this machine.
//
// A holder on the same machine need not push its bytes through a socket: with
// process_vm_readv(2) the puller copies them from the holder's snapshot region
// into its own, one copy where a loopback TCP transfer makes two, and none of
// its per-packet work. The kernel allows it when the puller may ptrace the
// holder (same user; Yama's ptrace_scope, where present, may forbid it; a
// holder that is not dumpable forbids it): otherwise kUnavailable, and the
// caller pulls over its transport instead.
#pragma once

#include <sys/types.h>

#include <cstdint>

#include "common/status.h"
#include "common/deadline.h"
#include "net/transport.h"
#include "store/replica_store.h"

namespace peerstate {

// Takes chunks from plan.queue until none is left, copies each from the same
// offset of `remote_region` (the holder's region of the version, in process
// `pid`) into plan.region, and marks it done once its CRC32C matches
// plan.meta.checksums. Blocks until the queue is drained or the first error;
// the chunk in hand is then given back for other sources and the error
// returned: kUnavailable (not permitted), kConnectionError (the process is
// gone, or the address is no longer mapped), kChecksumMismatch (the bytes
// there are not that version's).
// The holder must not reuse that region while it is read; a holder that does
// is caught by the checksums.
Status receive_from_process(pid_t pid, uintptr_t remote_region, const TransferPlan& plan);

// Adopts a replica a stopped process on this machine holds (a hung worker,
// its ProcessIndex read with read_process_index): copies version `meta` of
// meta.source_rank from `remote_region` in process `pid` into `store` as a
// committed version, every chunk checked against meta.checksums, reserving
// room for it first when the store has less. Blocks until done or the first
// error (as receive_from_process's; kInvalidArgument when the store already
// holds that version or a newer one, kUnavailable for a device replica store).
// A failed adoption leaves the store's committed versions as they were.
Status adopt_replica_from_process(pid_t pid, uintptr_t remote_region, const VersionMeta& meta, ReplicaStore* store);

}  // namespace peerstate

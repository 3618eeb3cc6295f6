// The nccl transport's factory (implementation: csrc/device/cuda/nccl_transport.cu).
//
// The transport owns its communicator, created from a unique id that one rank
// makes with nccl_unique_id() and the others receive through the job's store,
// and its own CUDA stream. send()/receive() move each chunk with
// ncclSend/ncclRecv on that stream and are two-sided: the peer must make the
// matching call at the same time. Plan regions are device memory on `device`.
// Chunks are not checksummed on arrival (the bytes stay on the device);
// describe() is kUnavailable (metadata travels over tcp). abort() calls
// ncclCommAbort, which makes every pending and later call fail with kAborted.
// A transfer that does not finish by timeout_ms aborts the communicator and
// returns kTimeout; one whose communicator reports an asynchronous error (a peer
// gone) aborts it too and returns kConnectionError. Host-only builds return kUnavailable.
#pragma once

#include <memory>

#include "device/nccl_library.h"
#include "net/transport.h"

namespace peerstate {

// kUnavailable, saying why, where this build has no nccl transport (host-only builds).
Status nccl_transport_built();
Status nccl_unique_id(const NcclLibrary& nccl, NcclUniqueId* out);
Status create_nccl_transport(const NcclLibrary& nccl, const NcclUniqueId& id, int nranks, int rank, int device,
                             long timeout_ms, std::unique_ptr<Transport>* out);

}  // namespace peerstate

// DeviceCopyEngine: the snapshot store's only window onto GPU memory.
//
// The host-only build links device/host_only.cc, whose create() fails with
// kUnavailable; a CUDA build links device/cuda/cuda_device_copy.cu. The core never
// includes a CUDA header, so the CPU build sees no CUDA code. The interface lives
// in common/ so that store/ holds an engine without depending on device/, which
// sits above net/ (its NCCL transport is a net::Transport).
//
// Threading: begin_to_host() is called from one thread at a time (the store
// serialises it); wait_to_host() may be called from any worker thread,
// concurrently, for different tickets; to_device(), to_host() and the
// allocation calls are safe from any thread (copies on one device share its
// stream, so concurrent callers are served in turn).
//
// Memory: the engine owns its streams and events. Host memory passed to it
// belongs to the caller; pin() must precede any transfer into or out of it
// and unpin() must follow the last one, before the memory is freed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace peerstate {

struct DeviceCopy {
  void* host;          // pinned host memory
  void* device;        // device pointer on `device_index`
  size_t nbytes;
};

class DeviceCopyEngine {
 public:
  virtual ~DeviceCopyEngine() = default;

  // Page-locks [ptr, ptr+nbytes) so that copies into it are true async DMA.
  virtual Status pin(void* ptr, size_t nbytes) = 0;
  virtual Status unpin(void* ptr) = 0;

  // Makes every later copy on `device_index` wait for the work queued so far
  // on `stream` (a cudaStream_t owned by the caller, e.g. torch's current
  // stream; 0 is the legacy default stream). Does not block.
  virtual Status order_after_stream(int device_index, uintptr_t stream) = 0;

  // Queues device-to-host copies on the engine's own stream for the device and
  // marks their completion as `ticket` (0 <= ticket < max_tickets given to
  // reserve_tickets). Returns at once.
  virtual Status begin_to_host(int device_index, const DeviceCopy* copies, size_t count,
                               size_t ticket) = 0;
  // Blocks until the copies of `ticket` have landed in host memory.
  virtual Status wait_to_host(size_t ticket) = 0;
  // Grows the ticket table (events are created once and reused every snapshot).
  virtual Status reserve_tickets(size_t max_tickets) = 0;

  // Copies host-to-device and blocks until the bytes are on the device.
  virtual Status to_device(int device_index, const DeviceCopy* copies, size_t count) = 0;
  // Copies device-to-host and blocks until the bytes are in host memory.
  virtual Status to_host(int device_index, const DeviceCopy* copies, size_t count) = 0;

  // Device memory owned by the caller until free_device() (cudaMalloc/cudaFree).
  virtual Status allocate_device(int device_index, size_t nbytes, void** out) = 0;
  virtual void free_device(int device_index, void* ptr) = 0;

  // Creates the engine of this build; kUnavailable when the build has no CUDA
  // or the machine has no usable GPU, with a message that says which.
  static Status create(std::unique_ptr<DeviceCopyEngine>* out);
};

// What the build has, and what the machine has.
bool cuda_compiled();
bool cuda_available();
int cuda_device_count();

}  // namespace peerstate

// Host memory regions for snapshots and replicas.
//
// A HostRegion is page-aligned, zero-filled anonymous memory, advised for
// transparent huge pages and faulted in up front so the first snapshot does
// not pay for page faults. It is move-only and frees itself; it can be pinned
// for DMA by a DeviceCopyEngine (see device_copy.h), which is then told to
// unpin it before it is freed.
#pragma once

#include <cstddef>

#include "common/status.h"

namespace peerstate {

class HostRegion {
 public:
  HostRegion() = default;
  ~HostRegion();
  HostRegion(HostRegion&& other) noexcept;
  HostRegion& operator=(HostRegion&& other) noexcept;
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  // Replaces this region with a fresh one of at least `nbytes` (kOutOfMemory on failure,
  // leaving this region as it was).
  Status allocate(size_t nbytes);
  void release();

  unsigned char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

// Physical memory of this machine in bytes (0 when unknown).
size_t physical_memory_bytes();

}  // namespace peerstate

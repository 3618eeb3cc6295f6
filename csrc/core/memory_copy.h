// Bulk copies into memory that will not be read again soon (snapshot regions).
#pragma once

#include <cstddef>

namespace peerstate {

// memcpy with non-temporal stores on x86-64 (plain memcpy elsewhere): skips
// the read-for-ownership of each destination cache line. With fence=true the
// stores are fenced before returning, so the bytes are visible to other
// threads; with fence=false the caller calls store_fence() after a run of copies.
void copy_streaming(void* dst, const void* src, size_t nbytes, bool fence = true);

// Orders all earlier non-temporal stores of this thread before later stores.
void store_fence();

}  // namespace peerstate

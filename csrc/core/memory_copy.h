// Bulk copies into memory that will not be read again soon (snapshot regions).
#pragma once

#include <cstddef>

namespace peerstate {

// memcpy with non-temporal stores on x86-64 (plain memcpy elsewhere): skips
// the read-for-ownership of each destination cache line. The stores are
// fenced before returning, so the bytes are visible to other threads.
void copy_streaming(void* dst, const void* src, size_t nbytes);

}  // namespace peerstate

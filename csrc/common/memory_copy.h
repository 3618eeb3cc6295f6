// Bulk copies into memory that will not be read again soon (snapshot regions).
#pragma once

#include <cstddef>

namespace peerstate {

// The memory walk of both streaming copies (copy_streaming here, crc32c_copy in
// crc32c.h): blocks of kStreamLanes lanes of kStreamLane bytes (a page each),
// a 64-byte line of each lane in turn, each lane prefetched kStreamPrefetch
// bytes ahead. It is glibc's large-copy walk: four streams keep more DRAM pages
// open and more prefetchers busy than one (~10% faster on multi-GiB copies).
inline constexpr size_t kStreamLanes = 4;
inline constexpr size_t kStreamLane = 4096;
inline constexpr size_t kStreamPrefetch = 256;

// memcpy with non-temporal stores on x86-64 (plain memcpy elsewhere): skips
// the read-for-ownership of each destination cache line. With fence=true the
// stores are fenced before returning, so the bytes are visible to other
// threads; with fence=false the caller calls store_fence() after a run of copies.
void copy_streaming(void* dst, const void* src, size_t nbytes, bool fence = true);

// Orders all earlier non-temporal stores of this thread before later stores.
void store_fence();

}  // namespace peerstate

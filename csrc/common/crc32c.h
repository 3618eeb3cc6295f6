// CRC32C (Castagnoli) checksums, with a fused copy-and-checksum.
//
// All functions are thread-safe and allocation-free. `crc` arguments and
// results are finished CRC32C values, so crc32c_extend(crc32c_extend(0, a), b)
// equals the CRC32C of a followed by b. On x86-64 with SSE4.2 the crc32
// instruction is used, three lanes at a time; elsewhere a portable
// slicing-by-8 table. Both give identical results.
#pragma once

#include <cstddef>
#include <cstdint>

namespace peerstate {

enum class Crc32cImplementation { kAuto, kHardware, kSoftware };

// CRC32C of data[0, nbytes), continued from `crc`.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t nbytes,
                       Crc32cImplementation impl = Crc32cImplementation::kAuto);

// Copies src to dst (no overlap) and returns the CRC32C of the copied bytes,
// continued from `crc`, reading each byte once: checksumming rides on the copy.
// The hardware path writes with non-temporal stores; with fence=false the
// caller must call store_fence() (memory_copy.h) before other threads read dst,
// which lets a run of small copies share one fence.
uint32_t crc32c_copy(void* dst, const void* src, size_t nbytes, uint32_t crc,
                     Crc32cImplementation impl = Crc32cImplementation::kAuto, bool fence = true);

// True when this CPU has the crc32 instruction (the kHardware path exists).
bool crc32c_hardware_available();

}  // namespace peerstate

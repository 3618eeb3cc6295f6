// Layout: where each registered buffer's bytes sit in a version's host region.
//
// Buffers are laid end to end, 64-byte aligned, and cut into chunks of at most
// `chunk_bytes`: many small buffers share a chunk, a large one spans several;
// host and device buffers never share one. A chunk is the unit of checksums and
// of transfer. The layout is a pure function of the buffer list (names, sizes,
// devices, order) and chunk_bytes, so a peer rebuilds it from those alone and
// never has to trust offsets it was sent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace peerstate {

constexpr int kHostDevice = -1;         // `device` value of a buffer in host memory
constexpr size_t kLayoutAlignment = 64;  // of every buffer in a region; the least chunk_bytes

struct BufferRegistration {
  std::string name;
  void* ptr = nullptr;
  size_t nbytes = 0;
  int device = kHostDevice;  // CUDA device index, or kHostDevice
  std::string dtype;         // what the bytes are, e.g. "torch.float32[1024,4096]"; compared, never parsed
};

// Where a buffer's bytes sit in a version's host region.
struct BufferPlacement {
  std::string name;
  size_t nbytes = 0;
  int device = kHostDevice;
  size_t offset = 0;  // in the version's region
  std::string dtype;
};

struct ChunkPlacement {
  size_t offset = 0;  // in the version's region
  size_t nbytes = 0;  // from `offset`, padding included
  int device = kHostDevice;
  uint32_t first_segment = 0;
  uint32_t segment_count = 0;
};

// A contiguous run of one buffer's bytes inside one chunk. A chunk's checksum
// is the CRC32C of its segments' bytes, in order (alignment padding excluded).
struct Segment {
  uint32_t buffer = 0;
  size_t buffer_offset = 0;
  size_t region_offset = 0;
  size_t nbytes = 0;
};

struct Layout {
  std::vector<BufferPlacement> buffers;
  std::vector<Segment> segments;
  std::vector<ChunkPlacement> chunks;
  size_t region_bytes = 0;
  size_t chunk_bytes = 0;  // what it was built with
  bool has_device_buffers = false;

  // Empty when `other` describes the same buffers (names, sizes, dtypes, devices, order);
  // else a sentence naming the first difference.
  std::string difference(const Layout& other) const;
};

// CRC32C of chunk `c` as it lies in `region` (over its segments, in order).
uint32_t chunk_checksum(const Layout& layout, size_t c, const unsigned char* region);

// Fills chunk `c` at `chunk_dst` (its place in a region) piece by piece with
// `read(dst, max, &got)`, which writes 1..max bytes at dst, and sets *crc to
// the chunk's CRC32C, each piece checksummed while it is still in cache.
// Returns the first error of `read`.
using ChunkReader = std::function<Status(unsigned char* dst, size_t max, size_t* got)>;
Status fill_chunk(const Layout& layout, size_t c, unsigned char* chunk_dst, const ChunkReader& read, uint32_t* crc);

// Builds the layout of `buffers` (kInvalidArgument for chunk_bytes < 64).
Status build_layout(const std::vector<BufferRegistration>& buffers, size_t chunk_bytes, Layout* out);

}  // namespace peerstate

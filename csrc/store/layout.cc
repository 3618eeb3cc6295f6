#include "store/layout.h"

#include <algorithm>

#include "common/crc32c.h"

namespace peerstate {
namespace {

size_t align_up(size_t n) { return (n + kLayoutAlignment - 1) / kLayoutAlignment * kLayoutAlignment; }

std::string device_name(int device) {
  return device == kHostDevice ? std::string("host") : "cuda:" + std::to_string(device);
}

}  // namespace

std::string Layout::difference(const Layout& other) const {
  if (buffers.size() != other.buffers.size())
    return "it holds " + std::to_string(buffers.size()) + " buffers, the registration has " +
           std::to_string(other.buffers.size());
  for (size_t i = 0; i < buffers.size(); i++) {
    const BufferPlacement& a = buffers[i];
    const BufferPlacement& b = other.buffers[i];
    if (a.name != b.name)
      return "buffer #" + std::to_string(i) + " is '" + a.name + "' there and '" + b.name +
             "' now";
    if (a.nbytes != b.nbytes)
      return "buffer '" + a.name + "' had " + std::to_string(a.nbytes) + " bytes and now has " +
             std::to_string(b.nbytes);
    if (a.dtype != b.dtype)
      return "buffer '" + a.name + "' held " + (a.dtype.empty() ? std::string("untyped bytes") : a.dtype) +
             " and now holds " + (b.dtype.empty() ? std::string("untyped bytes") : b.dtype);
    if (a.device != b.device)
      return "buffer '" + a.name + "' was on " + device_name(a.device) + " and is now on " +
             device_name(b.device);
  }
  return "";
}

Status build_layout(const std::vector<BufferRegistration>& buffers, size_t chunk_bytes, Layout* out) {
  if (chunk_bytes < kLayoutAlignment)
    return Status(StatusCode::kInvalidArgument, "chunk_bytes must be at least " + std::to_string(kLayoutAlignment) +
                                                    " (got " + std::to_string(chunk_bytes) + ")");
  Layout layout;
  std::vector<size_t> order(buffers.size());
  for (size_t i = 0; i < order.size(); i++) order[i] = i;
  // Host first, then each device: a chunk never mixes memory kinds.
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return buffers[a].device < buffers[b].device; });

  size_t offset = 0;
  ChunkPlacement chunk;
  bool open = false;
  auto close_chunk = [&] {
    if (open && chunk.segment_count > 0) {
      chunk.nbytes = offset - chunk.offset;
      layout.chunks.push_back(chunk);
    }
    open = false;
  };
  auto open_chunk = [&](int device) {
    close_chunk();
    chunk = ChunkPlacement();
    chunk.offset = offset;
    chunk.device = device;
    chunk.first_segment = static_cast<uint32_t>(layout.segments.size());
    open = true;
  };

  for (size_t index : order) {
    const BufferRegistration& b = buffers[index];
    offset = align_up(offset);
    if (!open || chunk.device != b.device) open_chunk(b.device);
    BufferPlacement placement{b.name, b.nbytes, b.device, offset, b.dtype};
    const uint32_t buffer_index = static_cast<uint32_t>(layout.buffers.size());
    layout.buffers.push_back(placement);
    layout.has_device_buffers |= b.device != kHostDevice;
    size_t done = 0;
    while (done < b.nbytes) {
      if (offset - chunk.offset >= chunk_bytes) open_chunk(b.device);
      size_t take = std::min(b.nbytes - done, chunk_bytes - (offset - chunk.offset));
      layout.segments.push_back(Segment{buffer_index, done, offset, take});
      chunk.segment_count++;
      offset += take;
      done += take;
    }
  }
  close_chunk();
  layout.region_bytes = align_up(offset);
  layout.chunk_bytes = chunk_bytes;
  *out = std::move(layout);
  return Status::Ok();
}

Status fill_chunk(const Layout& layout, size_t c, unsigned char* chunk_dst, const ChunkReader& read, uint32_t* crc) {
  const ChunkPlacement& chunk = layout.chunks[c];
  const Segment* seg = layout.segments.data() + chunk.first_segment;
  const Segment* const end = seg + chunk.segment_count;
  constexpr size_t kPiece = 256 * 1024;  // fits in L2 with room to spare
  uint32_t sum = 0;
  size_t at = chunk.offset;  // region offset filled so far
  const size_t stop = chunk.offset + chunk.nbytes;
  while (at < stop) {
    size_t got = 0;
    PEERSTATE_RETURN_IF_ERROR(read(chunk_dst + (at - chunk.offset), std::min(kPiece, stop - at), &got));
    // Checksum the parts of segments inside [at, at + got); padding between segments is skipped.
    for (; seg != end && seg->region_offset < at + got;) {
      const size_t lo = std::max(seg->region_offset, at);
      const size_t hi = std::min(seg->region_offset + seg->nbytes, at + got);
      if (lo < hi) sum = crc32c_extend(sum, chunk_dst + (lo - chunk.offset), hi - lo);
      if (seg->region_offset + seg->nbytes <= at + got)
        ++seg;
      else
        break;
    }
    at += got;
  }
  *crc = sum;
  return Status::Ok();
}

uint32_t chunk_checksum(const Layout& layout, size_t c, const unsigned char* region) {
  const ChunkPlacement& chunk = layout.chunks[c];
  uint32_t crc = 0;
  for (uint32_t s = 0; s < chunk.segment_count; s++) {
    const Segment& seg = layout.segments[chunk.first_segment + s];
    crc = crc32c_extend(crc, region + seg.region_offset, seg.nbytes);
  }
  return crc;
}

}  // namespace peerstate

#include "store/parity.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>


namespace peerstate {
namespace {

// A block stays in the first levels of cache while every source is folded into
// it: one pass over the destination whatever the number of sources.
constexpr size_t kBlock = 64 << 10;
// A thread's span: whole blocks, so that spans never share a cache line.
constexpr size_t kSpanAlignment = kBlock;

// dst[0, n) = (accumulate ? dst : 0) ^ srcs[0][0, n) ^ .. ^ srcs[count - 1][0, n), count <= 4: one
// pass over all of them, so the prefetchers follow every stream at once and dst is
// written once.
template <int kCount>
void fold(unsigned char* __restrict dst, const unsigned char* const* srcs, size_t n, bool accumulate) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    uint64_t d[8];
    if (accumulate) {
      std::memcpy(d, dst + i, sizeof d);
    } else {
      std::memcpy(d, srcs[0] + i, sizeof d);
    }
    for (int s = accumulate ? 0 : 1; s < kCount; s++) {
      uint64_t w[8];
      std::memcpy(w, srcs[s] + i, sizeof w);
      for (int lane = 0; lane < 8; lane++) d[lane] ^= w[lane];
    }
    std::memcpy(dst + i, d, sizeof d);
  }
  for (; i < n; i++) {
    unsigned char d = accumulate ? dst[i] : srcs[0][i];
    for (int s = accumulate ? 0 : 1; s < kCount; s++) d ^= srcs[s][i];
    dst[i] = d;
  }
}

void fold_some(unsigned char* dst, const unsigned char* const* srcs, int count, size_t n, bool accumulate) {
  switch (count) {
    case 1: return fold<1>(dst, srcs, n, accumulate);
    case 2: return fold<2>(dst, srcs, n, accumulate);
    case 3: return fold<3>(dst, srcs, n, accumulate);
    default: return fold<4>(dst, srcs, n, accumulate);
  }
}

// destination[begin, end) from the sources' bytes in that range, a block at a time:
// the block stays in cache across the folds of more than four sources, and a source
// that ends inside it is folded over its own bytes only.
void xor_range(unsigned char* destination, size_t begin, size_t end, const std::vector<ParitySource>& sources,
               bool accumulate) {
  std::vector<const unsigned char*> full;
  full.reserve(sources.size());
  for (size_t block = begin; block < end; block += kBlock) {
    const size_t block_end = std::min(end, block + kBlock), n = block_end - block;
    unsigned char* out = destination + block;
    bool written = accumulate;
    full.clear();
    for (const auto& [data, length] : sources) {
      if (length >= block_end) full.push_back(static_cast<const unsigned char*>(data) + block);
    }
    for (size_t at = 0; at < full.size(); at += 4) {
      const int count = static_cast<int>(std::min<size_t>(4, full.size() - at));
      fold_some(out, full.data() + at, count, n, written);
      written = true;
    }
    if (!written) std::memset(out, 0, n);
    for (const auto& [data, length] : sources) {  // those that end inside this block
      if (length > block && length < block_end) {
        const unsigned char* from = static_cast<const unsigned char*>(data) + block;
        fold<1>(out, &from, length - block, true);
      }
    }
  }
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes;
}

}  // namespace

ParityCoder::ParityCoder(size_t threads)
    : threads_(threads), pool_(threads > 1 ? ThreadPool::shared(threads) : nullptr) {}

Status ParityCoder::xor_blocks(void* destination, size_t nbytes, const std::vector<ParitySource>& sources,
                               bool accumulate) const {
  if (threads_ == 0) return Status(StatusCode::kInvalidArgument, "ParityCoder: threads must be at least 1");
  if (destination == nullptr && nbytes)
    return Status(StatusCode::kInvalidArgument, "xor_blocks: the destination is null");
  for (size_t i = 0; i < sources.size(); i++) {
    const auto& [data, length] = sources[i];
    if (length > nbytes)
      return Status(StatusCode::kInvalidArgument, "xor_blocks: source " + std::to_string(i) + " has " +
                                                      std::to_string(length) + " bytes, more than the destination's " +
                                                      std::to_string(nbytes));
    if (data == nullptr && length)
      return Status(StatusCode::kInvalidArgument, "xor_blocks: source " + std::to_string(i) + " is null");
    if (overlaps(destination, nbytes, data, length))
      return Status(StatusCode::kInvalidArgument,
                    "xor_blocks: source " + std::to_string(i) + " overlaps the destination");
  }
  auto* out = static_cast<unsigned char*>(destination);
  const size_t spans = std::max<size_t>(1, std::min(threads_, (nbytes + kSpanAlignment - 1) / kSpanAlignment));
  const size_t span = (nbytes / spans + kSpanAlignment - 1) / kSpanAlignment * kSpanAlignment;
  auto run = [&](size_t t) {
    const size_t begin = std::min(nbytes, t * span), end = t + 1 == spans ? nbytes : std::min(nbytes, begin + span);
    xor_range(out, begin, end, sources, accumulate);
  };
  if (spans == 1) {
    run(0);
  } else {
    pool_->run(spans, run);
  }
  return Status::Ok();
}

ParityPiece parity_piece(const Layout& layout, size_t group_size, size_t piece) {
  ParityPiece out;
  const size_t count = layout.chunks.size(), pieces = group_size > 1 ? group_size - 1 : 1;
  if (piece >= pieces) return out;
  // The first chunk c with floor(c * pieces / count) >= piece is ceil(piece * count / pieces).
  auto first_of = [&](size_t p) { return static_cast<uint32_t>((p * count + pieces - 1) / pieces); };
  out.first_chunk = first_of(piece);
  out.end_chunk = first_of(piece + 1);
  if (out.end_chunk > out.first_chunk) {
    const ChunkPlacement& first = layout.chunks[out.first_chunk];
    const ChunkPlacement& last = layout.chunks[out.end_chunk - 1];
    out.region_offset = first.offset;
    out.nbytes = last.offset + last.nbytes - first.offset;
  }
  return out;
}

}  // namespace peerstate

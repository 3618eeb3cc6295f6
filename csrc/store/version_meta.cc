#include "store/version_meta.h"

#include <cstring>

namespace peerstate {
namespace {

constexpr size_t kMaxNameBytes = 4096;
constexpr size_t kMaxDtypeBytes = 256;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

class Reader {
 public:
  explicit Reader(const std::string& b) : data_(b) {}
  template <typename T>
  bool get(T* v) {
    if (data_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool get_string(size_t n, std::string* s) {
    if (data_.size() - pos_ < n) return false;
    s->assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool at_end() const { return pos_ == data_.size(); }
  size_t left() const { return data_.size() - pos_; }

 private:
  const std::string& data_;
  size_t pos_ = 0;
};

Status bad_meta(const std::string& why) {
  return Status(StatusCode::kProtocolError, "malformed version metadata: " + why);
}

}  // namespace

VersionMeta meta_of(int32_t source_rank, const VersionView& view) {
  VersionMeta meta;
  meta.source_rank = source_rank;
  meta.version = view.version;
  meta.chunk_bytes = view.layout->chunk_bytes;
  meta.buffers = view.layout->buffers;
  meta.checksums = view.checksums;
  meta.layout = view.layout;
  return meta;
}

Status finish_meta(VersionMeta* meta) {
  std::vector<BufferRegistration> regs;
  regs.reserve(meta->buffers.size());
  for (const BufferPlacement& b : meta->buffers)
    regs.push_back(BufferRegistration{b.name, nullptr, b.nbytes, b.device, b.dtype});
  auto layout = std::make_shared<Layout>();
  PEERSTATE_RETURN_IF_ERROR(build_layout(regs, meta->chunk_bytes, layout.get()));
  if (meta->checksums.size() != layout->chunks.size())
    return bad_meta(std::to_string(meta->checksums.size()) + " checksums for " + std::to_string(layout->chunks.size()) +
                    " chunks");
  meta->buffers = layout->buffers;
  meta->layout = std::move(layout);
  return Status::Ok();
}

std::string encode_meta(const VersionMeta& meta) {
  std::string out;
  put<int32_t>(out, meta.source_rank);
  put<int64_t>(out, meta.version);
  put<uint64_t>(out, meta.chunk_bytes);
  put<uint32_t>(out, static_cast<uint32_t>(meta.buffers.size()));
  for (const BufferPlacement& b : meta.buffers) {
    put<uint16_t>(out, static_cast<uint16_t>(b.name.size()));
    out += b.name;
    put<uint64_t>(out, b.nbytes);
    put<int32_t>(out, b.device);
    put<uint16_t>(out, static_cast<uint16_t>(b.dtype.size()));
    out += b.dtype;
  }
  put<uint32_t>(out, static_cast<uint32_t>(meta.checksums.size()));
  for (uint32_t c : meta.checksums) put<uint32_t>(out, c);
  return out;
}

Status decode_meta(const std::string& bytes, VersionMeta* out) {
  Reader r(bytes);
  VersionMeta meta;
  uint64_t chunk_bytes = 0;
  uint32_t count = 0;
  if (!r.get(&meta.source_rank) || !r.get(&meta.version) || !r.get(&chunk_bytes) || !r.get(&count))
    return bad_meta("truncated header");
  if (chunk_bytes < kLayoutAlignment || chunk_bytes > (1ull << 40)) return bad_meta("chunk_bytes out of range");
  // Each buffer takes at least 17 bytes on the wire: a count larger than that is a lie.
  if (count > r.left() / 17) return bad_meta("buffer count exceeds the payload");
  meta.chunk_bytes = chunk_bytes;
  uint64_t total = 0;
  for (uint32_t i = 0; i < count; i++) {
    uint16_t name_bytes = 0, dtype_bytes = 0;
    BufferPlacement b;
    uint64_t nbytes = 0;
    if (!r.get(&name_bytes) || name_bytes == 0 || name_bytes > kMaxNameBytes || !r.get_string(name_bytes, &b.name) ||
        !r.get(&nbytes) || !r.get(&b.device) || !r.get(&dtype_bytes) || dtype_bytes > kMaxDtypeBytes ||
        !r.get_string(dtype_bytes, &b.dtype))
      return bad_meta("truncated or invalid buffer entry " + std::to_string(i));
    if (b.device < kHostDevice) return bad_meta("invalid device");
    if (nbytes > (1ull << 44) || (total += nbytes) > (1ull << 46)) return bad_meta("buffer sizes out of range");
    b.nbytes = nbytes;
    meta.buffers.push_back(std::move(b));
  }
  uint32_t checksums = 0;
  if (!r.get(&checksums) || checksums > r.left() / 4) return bad_meta("checksum count exceeds the payload");
  meta.checksums.resize(checksums);
  for (uint32_t& c : meta.checksums) r.get(&c);
  if (!r.at_end()) return bad_meta("trailing bytes");
  // Each chunk holds at most chunk_bytes, so the layout has at least total /
  // chunk_bytes chunks; refuse before building a layout that large.
  if (total / chunk_bytes > meta.checksums.size())
    return bad_meta(std::to_string(total) + " bytes in chunks of " + std::to_string(chunk_bytes) +
                    " need more chunks than the " + std::to_string(meta.checksums.size()) + " checksums sent");
  PEERSTATE_RETURN_IF_ERROR(finish_meta(&meta));
  *out = std::move(meta);
  return Status::Ok();
}

}  // namespace peerstate

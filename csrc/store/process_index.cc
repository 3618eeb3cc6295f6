#include "store/process_index.h"

#include <cstring>

#include "common/process_memory_read.h"

namespace peerstate {
namespace {

constexpr uint64_t kMagic = 0x78646e4974736570ull;  // "pestIndx"
constexpr uint64_t kMaxIndexBytes = 64ull << 20;
constexpr size_t kEntryFixedBytes = 4 + 4 + 8 + 8 + 8 + 4;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <typename T>
bool take(const std::string& in, size_t* pos, T* v) {
  if (in.size() - *pos < sizeof(T)) return false;
  std::memcpy(v, in.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

Status read_remote(pid_t pid, uintptr_t address, void* dst, size_t nbytes) {
  for (size_t done = 0, got = 0; done < nbytes; done += got)
    PEERSTATE_RETURN_IF_ERROR(read_process_memory(pid, address + done, static_cast<char*>(dst) + done,
                                                  nbytes - done, &got));
  return Status::Ok();
}

}  // namespace

static_assert(sizeof(std::atomic<uint64_t>) == 8, "the header is read as six 64-bit words");

ProcessIndex::ProcessIndex() {
  header_.magic = kMagic;
  header_.data[0] = header_.data[1] = 0;
  header_.size[0] = header_.size[1] = 0;
  header_.current.store(0, std::memory_order_release);
}

void ProcessIndex::set(uint32_t store, std::vector<Entry> entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  by_store_[store] = std::move(entries);
  const uint64_t next = 1 - header_.current.load(std::memory_order_relaxed);
  std::string& out = buffers_[next];
  out.clear();
  for (const auto& [tag, list] : by_store_)
    for (const Entry& e : list) {
      put(out, e.store);
      put(out, e.source_rank);
      put(out, e.version);
      put(out, e.region);
      put(out, e.nbytes);
      put(out, static_cast<uint32_t>(e.meta.size()));
      out.append(e.meta);
    }
  header_.data[next] = reinterpret_cast<uint64_t>(out.data());
  header_.size[next] = out.size();
  header_.current.store(next, std::memory_order_release);
}

std::vector<ProcessIndex::Entry> ProcessIndex::entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Entry> all;
  for (const auto& [tag, list] : by_store_) all.insert(all.end(), list.begin(), list.end());
  return all;
}

Status read_process_index(pid_t pid, uintptr_t address, std::vector<ProcessIndex::Entry>* out) {
  out->clear();
  uint64_t header[6];
  PEERSTATE_RETURN_IF_ERROR(read_remote(pid, address, header, sizeof(header)));
  const uint64_t current = header[1];
  auto not_index = [&](const std::string& why) {
    return Status(StatusCode::kProtocolError, "what process " + std::to_string(pid) + " holds at that address is "
                                              "not a peerstate index: " + why);
  };
  if (header[0] != kMagic) return not_index("no magic number");
  if (current > 1) return not_index("its current buffer is " + std::to_string(current));
  const uint64_t data = header[2 + current];
  const uint64_t size = header[4 + current];
  if (size > kMaxIndexBytes) return not_index(std::to_string(size) + " bytes");
  std::string bytes(size, '\0');
  if (size > 0) PEERSTATE_RETURN_IF_ERROR(read_remote(pid, data, bytes.data(), size));
  size_t pos = 0;
  while (pos < bytes.size()) {
    ProcessIndex::Entry e;
    uint32_t meta_bytes = 0;
    if (bytes.size() - pos < kEntryFixedBytes || !take(bytes, &pos, &e.store) || !take(bytes, &pos, &e.source_rank) ||
        !take(bytes, &pos, &e.version) || !take(bytes, &pos, &e.region) || !take(bytes, &pos, &e.nbytes) ||
        !take(bytes, &pos, &meta_bytes) || bytes.size() - pos < meta_bytes)
      return not_index("an entry is cut short");
    e.meta.assign(bytes.data() + pos, meta_bytes);
    pos += meta_bytes;
    out->push_back(std::move(e));
  }
  return Status::Ok();
}

}  // namespace peerstate

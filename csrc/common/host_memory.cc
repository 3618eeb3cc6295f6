#include "common/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace peerstate {

HostRegion::~HostRegion() { release(); }

HostRegion::HostRegion(HostRegion&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

HostRegion& HostRegion::operator=(HostRegion&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Status HostRegion::allocate(size_t nbytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t size = nbytes == 0 ? page : (nbytes + page - 1) / page * page;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status(StatusCode::kOutOfMemory, "could not allocate " + std::to_string(size) +
                                                " bytes of host memory for snapshots: " +
                                                std::strerror(errno));
  }
  // Huge pages cut TLB misses on multi-GiB copies; advice only, failure is harmless.
  madvise(p, size, MADV_HUGEPAGE);
  // Fault every page in now: an untouched mapping costs a page fault per 4 KiB
  // on the first snapshot, which would land on the training step.
  std::memset(p, 0, size);
  release();
  data_ = static_cast<unsigned char*>(p);
  size_ = size;
  return Status::Ok();
}

void HostRegion::release() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

size_t physical_memory_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

}  // namespace peerstate

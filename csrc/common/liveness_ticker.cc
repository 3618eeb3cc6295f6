#include "common/liveness_ticker.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "common/thread_name.h"

namespace peerstate {

struct LivenessTicker::Tick {
  Tick(void* map, size_t map_bytes, uint64_t* word, int interval_ms)
      : map(map), map_bytes(map_bytes), word(word), interval_ms(interval_ms),
        count(__atomic_load_n(word, __ATOMIC_RELAXED)) {}  // a restart counts on, never back
  ~Tick() { ::munmap(map, map_bytes); }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!wake.wait_for(lock, std::chrono::milliseconds(interval_ms), [this] { return stopping; })) {
      __atomic_store_n(word, ++count, __ATOMIC_RELAXED);
    }
  }

  void* const map;
  const size_t map_bytes;
  uint64_t* const word;
  const int interval_ms;
  uint64_t count;  // written by the thread only; read through the word
  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;
};

Status LivenessTicker::start(const std::string& path, size_t offset, int interval_ms,
                             std::unique_ptr<LivenessTicker>* out) {
  if (offset % 8 != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "the liveness word's offset must be a multiple of 8 (got " + std::to_string(offset) + ")");
  }
  if (interval_ms < 1) {
    return Status(StatusCode::kInvalidArgument,
                  "the liveness interval must be at least 1 ms (got " + std::to_string(interval_ms) + ")");
  }
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return Status(StatusCode::kNotFound, "cannot open the progress file " + path + ": " + std::strerror(errno));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0 || static_cast<size_t>(info.st_size) < offset + 8) {
    ::close(fd);
    return Status(StatusCode::kInvalidArgument,
                  "the progress file " + path + " has no 8-byte word at offset " + std::to_string(offset) +
                      " (is the agent's peerstate the same version as the worker's?)");
  }
  size_t map_bytes = offset + 8;
  void* map = ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file
  if (map == MAP_FAILED) {
    return Status(StatusCode::kNotFound, "cannot map the progress file " + path + ": " + std::strerror(errno));
  }
  auto* word = reinterpret_cast<uint64_t*>(static_cast<unsigned char*>(map) + offset);
  out->reset(new LivenessTicker(std::make_shared<Tick>(map, map_bytes, word, interval_ms)));
  return Status();
}

LivenessTicker::LivenessTicker(std::shared_ptr<Tick> tick) : tick_(std::move(tick)) {
  thread_ = std::thread([tick = tick_] {
    name_this_thread("ps-liveness");
    tick->run();
  });
}

LivenessTicker::~LivenessTicker() {
  if (thread_.joinable()) thread_.detach();  // the thread keeps its Tick: ticks until the process ends
}

void LivenessTicker::stop() {
  {
    std::lock_guard<std::mutex> lock(tick_->mutex);
    if (tick_->stopping) return;
    tick_->stopping = true;
  }
  tick_->wake.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t LivenessTicker::count() const { return __atomic_load_n(tick_->word, __ATOMIC_RELAXED); }

}  // namespace peerstate

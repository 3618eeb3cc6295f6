#include "net/transport.h"

namespace peerstate {

ChunkQueue::ChunkQueue(size_t count) : ChunkQueue(0, static_cast<uint32_t>(count)) {}

ChunkQueue::ChunkQueue(uint32_t first, uint32_t end) : count_(end > first ? end - first : 0) {
  free_.reserve(count_);
  for (uint32_t i = end; i > first; i--) free_.push_back(i - 1);  // the first chunk first
}

bool ChunkQueue::take(uint32_t* chunk) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !free_.empty() || in_progress_ == 0; });
  if (free_.empty()) return false;
  *chunk = free_.back();
  free_.pop_back();
  in_progress_++;
  return true;
}

bool ChunkQueue::try_take(uint32_t* chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.empty()) return false;
  *chunk = free_.back();
  free_.pop_back();
  in_progress_++;
  return true;
}

void ChunkQueue::complete(uint32_t) {
  std::lock_guard<std::mutex> lock(mutex_);
  in_progress_--;
  done_++;
  changed_.notify_all();
}

void ChunkQueue::give_back(uint32_t chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  in_progress_--;
  free_.push_back(chunk);
  changed_.notify_all();
}

bool ChunkQueue::finished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_ == count_;
}

size_t ChunkQueue::done_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

}  // namespace peerstate

#include "common/thread_pool.h"

#include <sched.h>

#include <map>

#include "common/thread_name.h"

namespace peerstate {

void ThreadPool::Job::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return signalled_; });
}

void ThreadPool::Job::finish_one() {
  if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 != count_) return;
  if (on_done_) on_done_();
  std::lock_guard<std::mutex> lock(mutex_);
  signalled_ = true;
  cv_.notify_all();
}

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) threads = 1;
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; i++) workers_.emplace_back([this] {
    name_this_thread("ps-copy");
    worker_loop();
  });
}

std::shared_ptr<ThreadPool> ThreadPool::shared(size_t threads) {
  static std::mutex mutex;
  static std::map<size_t, std::weak_ptr<ThreadPool>> pools;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<ThreadPool> pool = pools[threads].lock();
  if (!pool) {
    pool = std::make_shared<ThreadPool>(threads);
    pools[threads] = pool;
  }
  return pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

std::shared_ptr<ThreadPool::Job> ThreadPool::submit(size_t count, std::function<void(size_t)> fn,
                                                    std::function<void()> on_done) {
  std::shared_ptr<Job> job(new Job(count, std::move(fn), std::move(on_done)));
  if (count == 0) {
    if (job->on_done_) job->on_done_();
    job->signalled_ = true;
    return job;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(job);
  }
  cv_.notify_all();
  return job;
}

void ThreadPool::run(size_t count, const std::function<void(size_t)>& fn) {
  submit(count, fn)->wait();
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    size_t item = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      for (;;) {
        // Drop exhausted jobs from the front; claim an item from the first live one.
        while (!queue_.empty() &&
               queue_.front()->next_.load(std::memory_order_relaxed) >= queue_.front()->count_)
          queue_.pop_front();
        if (!queue_.empty()) {
          job = queue_.front();
          item = job->next_.fetch_add(1, std::memory_order_relaxed);
          if (item < job->count_) break;
          continue;
        }
        if (stopping_) return;
        cv_.wait(lock);
      }
    }
    if (!job->cancelled()) job->fn_(item);
    job->finish_one();
  }
}

size_t available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<size_t>(n);
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? n : 1;
}

}  // namespace peerstate

// A fixed pool of worker threads that runs parallel-for jobs.
//
// A job is `count` independent items and a function called once per item,
// from any worker, in any order. submit() returns at once; Job::wait() blocks
// until every item has run (or was skipped after cancel()). Items of several
// jobs may run at the same time; jobs are served in submission order. The pool
// owns its threads; the destructor finishes queued jobs, then joins.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace peerstate {

class ThreadPool {
 public:
  class Job {
   public:
    // Blocks until every item has finished or been skipped.
    void wait();
    bool done() const { return finished_.load(std::memory_order_acquire) == count_; }
    // Items not yet started are skipped; running items finish. Does not block.
    void cancel() { cancelled_.store(true, std::memory_order_release); }
    bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

   private:
    friend class ThreadPool;
    Job(size_t count, std::function<void(size_t)> fn, std::function<void()> on_done)
        : count_(count), fn_(std::move(fn)), on_done_(std::move(on_done)) {}
    void finish_one();

    const size_t count_;
    std::function<void(size_t)> fn_;
    std::function<void()> on_done_;  // runs once, on the worker that finishes the last item
    std::atomic<size_t> next_{0};
    std::atomic<size_t> finished_{0};
    std::atomic<bool> cancelled_{false};
    std::mutex mutex_;
    std::condition_variable cv_;
    bool signalled_ = false;
  };

  explicit ThreadPool(size_t threads);
  // The process's pool of `threads` workers, shared by every caller that asks
  // for that many (the snapshot stores of one rank: its own and its shares'),
  // created on first use and destroyed with its last holder. Thread-safe.
  static std::shared_ptr<ThreadPool> shared(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Schedules fn(0) .. fn(count-1). `on_done` (optional) runs after the last item.
  std::shared_ptr<Job> submit(size_t count, std::function<void(size_t)> fn,
                              std::function<void()> on_done = nullptr);
  // submit() + wait(), for synchronous parallel loops.
  void run(size_t count, const std::function<void(size_t)>& fn);

  size_t size() const { return workers_.size(); }

 private:
  void worker_loop();

  std::vector<std::thread> workers_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

// Cores this process may run on (sched affinity), at least 1.
size_t available_cores();

}  // namespace peerstate

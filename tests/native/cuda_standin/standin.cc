// The CUDA runtime stand-in (see include/cuda_runtime.h for what it models).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

struct CUevent_st {
  std::mutex mutex;
  std::condition_variable done;
  unsigned long recorded = 0;   // records queued so far
  unsigned long completed = 0;  // the newest record its stream reached
};

struct CUstream_st {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::function<void()>> queue;
  bool running = false;  // an operation taken off the queue is running
  bool stopping = false;
  std::thread worker;

  CUstream_st() : worker([this] { run(); }) {}
  ~CUstream_st() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    changed.notify_all();
    worker.join();
  }
  void push(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      queue.push_back(std::move(op));
    }
    changed.notify_all();
  }
  bool idle() {
    std::lock_guard<std::mutex> lock(mutex);
    return queue.empty() && !running;
  }
  void drain() {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [this] { return queue.empty() && !running; });
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      changed.wait(lock, [this] { return stopping || !queue.empty(); });
      if (queue.empty()) return;  // stopping, with nothing left to run
      std::function<void()> op = std::move(queue.front());
      queue.pop_front();
      running = true;
      lock.unlock();
      op();
      lock.lock();
      running = false;
      changed.notify_all();
    }
  }
};

namespace {

std::mutex g_mutex;                             // the maps below
std::map<const char*, size_t> g_device;         // cudaMalloc'd ranges
std::map<const char*, size_t> g_registered;     // cudaHostRegister'd ranges
std::atomic<int> g_sticky{cudaSuccess};         // an asynchronous error, until reset
std::atomic<unsigned int> g_delay_us{0};
std::atomic<long> g_fail_at{0}, g_copies{0}, g_unpinned{0}, g_streams{0}, g_events{0};
thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;

cudaError_t fail(cudaError_t error) {
  t_last = error;
  return error;
}

int device_count() {
  const char* env = std::getenv("PEERSTATE_CUDA_STANDIN_DEVICES");
  return env != nullptr ? std::atoi(env) : 1;
}

bool within(const std::map<const char*, size_t>& ranges, const void* ptr, size_t nbytes) {
  const char* p = static_cast<const char*>(ptr);
  auto it = ranges.upper_bound(p);
  if (it == ranges.begin()) return false;
  --it;
  return p >= it->first && p + nbytes <= it->first + it->second;
}

CUstream_st* default_stream() {
  static CUstream_st stream;
  return &stream;
}

CUstream_st* resolve(cudaStream_t stream) { return stream != nullptr ? stream : default_stream(); }

cudaError_t sticky() { return static_cast<cudaError_t>(g_sticky.load()); }

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return *count > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t last = t_last;
  t_last = cudaSuccess;
  return sticky() != cudaSuccess ? sticky() : last;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return "stand-in error";
  }
}

cudaError_t cudaMalloc(void** ptr, size_t nbytes) {
  if (sticky() != cudaSuccess) return sticky();
  void* p = std::aligned_alloc(256, (nbytes + 255) / 256 * 256);
  if (p == nullptr) return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_device[static_cast<const char*>(p)] = nbytes;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_device.erase(static_cast<const char*>(ptr)) == 0) return fail(cudaErrorInvalidValue);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* ptr, size_t nbytes, unsigned int) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const char* p = static_cast<const char*>(ptr);
  if (ptr == nullptr || nbytes == 0 || within(g_device, ptr, 1)) return fail(cudaErrorInvalidValue);
  auto next = g_registered.lower_bound(p);
  if ((next != g_registered.end() && next->first < p + nbytes) || within(g_registered, ptr, 1))
    return fail(cudaErrorHostMemoryAlreadyRegistered);
  g_registered[p] = nbytes;
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_registered.erase(static_cast<const char*>(ptr)) == 0) return fail(cudaErrorHostMemoryNotRegistered);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = new CUstream_st();
  g_streams++;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return fail(cudaErrorInvalidResourceHandle);
  delete stream;  // runs what was queued first, as CUDA does
  g_streams--;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  resolve(stream)->drain();
  return sticky();
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (sticky() != cudaSuccess) return sticky();
  return resolve(stream)->idle() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  unsigned long target;
  {
    std::lock_guard<std::mutex> lock(event->mutex);
    target = event->recorded;  // the newest record at the call, as in CUDA
  }
  resolve(stream)->push([event, target] {
    std::unique_lock<std::mutex> lock(event->mutex);
    event->done.wait(lock, [&] { return event->completed >= target; });
  });
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t nbytes, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (sticky() != cudaSuccess) return sticky();
  bool ok = true, pinned = true;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const bool dst_device = within(g_device, dst, nbytes), src_device = within(g_device, src, nbytes);
    switch (kind) {
      case cudaMemcpyHostToDevice: ok = dst_device && !within(g_device, src, 1); break;
      case cudaMemcpyDeviceToHost: ok = src_device && !within(g_device, dst, 1); break;
      case cudaMemcpyDeviceToDevice: ok = dst_device && src_device; break;
      default: ok = false;
    }
    if (kind == cudaMemcpyHostToDevice) pinned = within(g_registered, src, nbytes);
    if (kind == cudaMemcpyDeviceToHost) pinned = within(g_registered, dst, nbytes);
  }
  if (!ok) return fail(cudaErrorInvalidValue);  // a pointer is not on the side `kind` says
  if (!pinned) g_unpinned++;
  const long nth = ++g_copies;
  const bool broken = g_fail_at.load() != 0 && nth == g_fail_at.load();
  const unsigned int delay = g_delay_us.load();
  resolve(stream)->push([=] {
    if (delay != 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    if (broken) {
      g_sticky = cudaErrorIllegalAddress;
      return;
    }
    if (sticky() == cudaSuccess) std::memcpy(dst, src, nbytes);
  });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = new CUevent_st();
  g_events++;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  g_events--;
  // CUDA defers the release until the event's work completes; the stand-in keeps
  // it (a few bytes) rather than track which queued operations still refer to it.
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  unsigned long generation;
  {
    std::lock_guard<std::mutex> lock(event->mutex);
    generation = ++event->recorded;
  }
  resolve(stream)->push([event, generation] {
    std::lock_guard<std::mutex> lock(event->mutex);
    if (generation > event->completed) event->completed = generation;
    event->done.notify_all();
  });
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return fail(cudaErrorInvalidResourceHandle);
  std::unique_lock<std::mutex> lock(event->mutex);
  const unsigned long target = event->recorded;
  event->done.wait(lock, [&] { return event->completed >= target; });
  return sticky();
}

void standin_set_copy_delay_us(unsigned int microseconds) { g_delay_us = microseconds; }

void standin_fail_copy(long nth) { g_fail_at = nth == 0 ? 0 : g_copies.load() + nth; }

void standin_reset_error(void) {
  g_sticky = cudaSuccess;
  g_fail_at = 0;
}

cudaError_t standin_launch_fill(cudaStream_t stream, void* ptr, unsigned char value, size_t nbytes,
                                unsigned int delay_us) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!within(g_device, ptr, nbytes)) return fail(cudaErrorInvalidValue);
  }
  resolve(stream)->push([=] {
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    unsigned char* bytes = static_cast<unsigned char*>(ptr);
    for (size_t i = 0; i < nbytes; i++) bytes[i] = standin_pattern(value, i);
  });
  return cudaSuccess;
}

cudaError_t standin_stream_push(cudaStream_t stream, void (*run)(void*), void* arg) {
  resolve(stream)->push([run, arg] { run(arg); });
  return cudaSuccess;
}

struct standin_counters standin_read_counters(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return standin_counters{g_streams.load(), g_events.load(), static_cast<long>(g_registered.size()),
                          static_cast<long>(g_device.size()), g_copies.load(), g_unpinned.load()};
}

}  // extern "C"

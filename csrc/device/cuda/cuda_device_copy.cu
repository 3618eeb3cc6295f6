// The CUDA implementation of DeviceCopyEngine (see common/device_copy.h).
//
// One non-blocking stream per device, so snapshot copies overlap the
// training's compute stream; one reusable event per ticket, so a snapshot
// allocates nothing. The runtime is linked statically and reaches the driver
// through dlopen, so loading the extension needs no CUDA library at all.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/device_copy.h"

namespace peerstate {
namespace {

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kCudaError,
                std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")");
}

#define PEERSTATE_CUDA_CHECK(call) PEERSTATE_RETURN_IF_ERROR(cuda_status((call), #call))

class CudaDeviceCopyEngine final : public DeviceCopyEngine {
 public:
  ~CudaDeviceCopyEngine() override {
    for (auto& ev : events_) cudaEventDestroy(ev);
    for (auto& kv : streams_) {
      cudaSetDevice(kv.first);
      cudaStreamDestroy(kv.second);
    }
  }

  Status pin(void* ptr, size_t nbytes) override {
    PEERSTATE_CUDA_CHECK(cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable));
    return Status::Ok();
  }

  Status unpin(void* ptr) override {
    PEERSTATE_CUDA_CHECK(cudaHostUnregister(ptr));
    return Status::Ok();
  }

  Status order_after_stream(int device_index, uintptr_t stream) override {
    cudaStream_t own;
    PEERSTATE_RETURN_IF_ERROR(stream_for(device_index, &own));
    cudaEvent_t marker;
    PEERSTATE_CUDA_CHECK(cudaEventCreateWithFlags(&marker, cudaEventDisableTiming));
    const Status recorded = cuda_status(
        cudaEventRecord(marker, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord(training stream)");
    const Status ordered =
        recorded.ok() ? cuda_status(cudaStreamWaitEvent(own, marker, 0), "cudaStreamWaitEvent") : recorded;
    cudaEventDestroy(marker);  // safe: destruction is deferred until the event completes
    return ordered;
  }

  Status reserve_tickets(size_t max_tickets) override {
    while (events_.size() < max_tickets) {
      cudaEvent_t ev;
      PEERSTATE_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      events_.push_back(ev);
    }
    return Status::Ok();
  }

  Status begin_to_host(int device_index, const DeviceCopy* copies, size_t count,
                       size_t ticket) override {
    if (ticket >= events_.size())
      return Status(StatusCode::kInternal, "device copy ticket out of range");
    cudaStream_t stream;
    PEERSTATE_RETURN_IF_ERROR(stream_for(device_index, &stream));
    for (size_t i = 0; i < count; i++)
      PEERSTATE_CUDA_CHECK(cudaMemcpyAsync(copies[i].host, copies[i].device, copies[i].nbytes,
                                           cudaMemcpyDeviceToHost, stream));
    PEERSTATE_CUDA_CHECK(cudaEventRecord(events_[ticket], stream));
    return Status::Ok();
  }

  Status wait_to_host(size_t ticket) override {
    if (ticket >= events_.size())
      return Status(StatusCode::kInternal, "device copy ticket out of range");
    PEERSTATE_CUDA_CHECK(cudaEventSynchronize(events_[ticket]));
    return Status::Ok();
  }

  Status to_device(int device_index, const DeviceCopy* copies, size_t count) override {
    return copy_and_wait(device_index, copies, count, cudaMemcpyHostToDevice);
  }

  Status to_host(int device_index, const DeviceCopy* copies, size_t count) override {
    return copy_and_wait(device_index, copies, count, cudaMemcpyDeviceToHost);
  }

  Status allocate_device(int device_index, size_t nbytes, void** out) override {
    PEERSTATE_CUDA_CHECK(cudaSetDevice(device_index));
    Status st = cuda_status(cudaMalloc(out, nbytes), "cudaMalloc");
    if (!st.ok())
      return Status(StatusCode::kOutOfMemory, "cannot allocate " + std::to_string(nbytes) + " bytes on cuda:" +
                                                  std::to_string(device_index) + ": " + st.message());
    return Status::Ok();
  }

  void free_device(int device_index, void* ptr) override {
    if (cudaSetDevice(device_index) == cudaSuccess) cudaFree(ptr);
  }

 private:
  Status stream_for(int device_index, cudaStream_t* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    PEERSTATE_CUDA_CHECK(cudaSetDevice(device_index));
    auto it = streams_.find(device_index);
    if (it == streams_.end()) {
      cudaStream_t s;
      PEERSTATE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      it = streams_.emplace(device_index, s).first;
    }
    *out = it->second;
    return Status::Ok();
  }

  Status copy_and_wait(int device_index, const DeviceCopy* copies, size_t count, cudaMemcpyKind kind) {
    cudaStream_t stream;
    PEERSTATE_RETURN_IF_ERROR(stream_for(device_index, &stream));
    for (size_t i = 0; i < count; i++) {
      void* to = kind == cudaMemcpyHostToDevice ? copies[i].device : copies[i].host;
      const void* from = kind == cudaMemcpyHostToDevice ? copies[i].host : copies[i].device;
      PEERSTATE_CUDA_CHECK(cudaMemcpyAsync(to, from, copies[i].nbytes, kind, stream));
    }
    PEERSTATE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return Status::Ok();
  }

  std::mutex mutex_;
  std::map<int, cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;
};

}  // namespace

Status DeviceCopyEngine::create(std::unique_ptr<DeviceCopyEngine>* out) {
  out->reset();
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    return Status(StatusCode::kUnavailable,
                  std::string("no usable CUDA device: ") +
                      (err == cudaSuccess ? "the driver reports 0 devices"
                                          : cudaGetErrorString(err)));
  }
  out->reset(new CudaDeviceCopyEngine());
  return Status::Ok();
}

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

bool cuda_available() { return cuda_device_count() > 0; }

}  // namespace peerstate
